#!/usr/bin/env python3
"""Container health check: exit 0 iff the gRPC server at ADDRESS reports SERVING (grpc.health.v1)."""
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        except grpc.RpcError as err:
            print(f"{address}: {err.code().name}", file=sys.stderr)
            return 1
    print(f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
