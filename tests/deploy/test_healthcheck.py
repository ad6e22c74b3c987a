"""docker/healthcheck.py (the images' specd-healthcheck) against a real gRPC health service on loopback, in
plaintext and under the mutual TLS a deployment turns on with SPECD_TLS_*."""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specd.ports import free_ports
from specd.security import TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV, TlsConfig

from .conftest import REPO

HEALTHCHECK = REPO / "docker" / "healthcheck.py"


@pytest.fixture
def serve_health():
    """serve_health(tls) -> the address of a health service reporting SERVING (mutual TLS when tls is given)."""
    servers = []

    def start(tls: TlsConfig | None) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        servicer = health.HealthServicer()
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        address = f"127.0.0.1:{free_ports(1)[0]}"
        if tls:
            server.add_secure_port(address, tls.server_credentials())
        else:
            server.add_insecure_port(address)
        server.start()
        servers.append(server)
        return address

    yield start
    for server in servers:
        server.stop(None)


def healthcheck(*args: str, tls: TlsConfig | None = None) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key not in (TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV)}
    if tls:
        env |= {TLS_CERT_ENV: str(tls.cert_file), TLS_KEY_ENV: str(tls.key_file), TLS_CA_ENV: str(tls.ca_file)}
    return subprocess.run([sys.executable, str(HEALTHCHECK), *args], env=env, capture_output=True, text=True,
                          timeout=60)


def test_a_plaintext_service_that_serves_is_healthy(serve_health):
    address = serve_health(None)
    result = healthcheck(address, "target")
    assert result.returncode == 0 and "SERVING" in result.stdout, result.stderr


def test_under_mutual_tls_the_check_presents_the_services_own_certificate(serve_health, certificates):
    address = serve_health(certificates.target)
    result = healthcheck(address, tls=certificates.target)
    assert result.returncode == 0, result.stderr


def test_the_server_name_is_checked_in_place_of_loopback(serve_health, certificates):
    address = serve_health(certificates.target)
    assert healthcheck(address, "localhost", tls=certificates.target).returncode == 0  # a name it carries
    refused = healthcheck(address, "not-the-target", tls=certificates.target)
    assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr


def test_a_tls_service_is_unhealthy_to_a_check_without_the_deployments_tls(serve_health, certificates):
    address = serve_health(certificates.target)
    result = healthcheck(address, "target")
    assert result.returncode == 1 and "UNAVAILABLE" in result.stderr
