#!/usr/bin/env python3
"""Container health check: exit 0 iff the gRPC server at ADDRESS reports SERVING (grpc.health.v1).

    specd-healthcheck ADDRESS [SERVER_NAME]

It speaks the service's own TLS, from the environment the service reads it from (SPECD_TLS_CERT, _KEY and
_CA), and presents the service's certificate: under mutual TLS the target and the drafters refuse any
client without one. SERVER_NAME is a name the certificate carries (the compose service's), checked in place
of ADDRESS's host, which is loopback inside the container.
"""
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd.security import TlsConfig


def channel_to(address: str, server_name: str | None) -> grpc.Channel:
    tls = TlsConfig.from_env()
    if tls is None:
        return grpc.insecure_channel(address)
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.secure_channel(address, tls.channel_credentials(), options=options)


def main(address: str, server_name: str | None = None) -> int:
    with channel_to(address, server_name) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        except grpc.RpcError as err:
            print(f"{address}: {err.code().name}", file=sys.stderr)
            return 1
    print(f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
