"""What every specd service shares around its servicers: the gRPC server bootstrap (health, TLS,
reflection, graceful shutdown on SIGTERM) and the Prometheus endpoint."""
from __future__ import annotations

import asyncio
import gc
import logging
import signal
from dataclasses import dataclass
from typing import Any, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from specd import defaults
from specd.rpc import SERVER_OPTIONS, UndecodableRequestInterceptor
from specd.security import TlsConfig, is_loopback

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# The health service name that is SERVING for as long as the process answers, whatever its upstreams:
# what a liveness probe asks (the gateway is NOT_SERVING while its target is down, and restarting the
# gateway would not bring the target back).
LIVENESS = "liveness"


@dataclass(frozen=True)
class Exposure:
    """How a service meets its clients: TLS (mutual for internal services when there is a CA), extra
    interceptors (the gateway's API key), and whether it answers reflection, which lists its methods
    to anyone: by default only on loopback."""
    tls: TlsConfig | None = None
    require_client_cert: bool = True
    interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()
    reflection: bool | None = None  # None: on loopback only

    def reflection_on(self, address: str) -> bool:
        return is_loopback(address) if self.reflection is None else self.reflection


@dataclass
class ServiceSpec:
    """One gRPC service to host: its `add_XServicer_to_server` function, servicer and full name."""
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    servicer: Any
    full_name: str


class Service:
    """A started gRPC server plus its /metrics endpoint."""

    def __init__(self, name: str, specs: list[ServiceSpec], address: str, metrics_address: str | None,
                 registry: CollectorRegistry, exposure: Exposure = Exposure()):
        self.name = name
        self._specs = specs
        self._address = address
        self._metrics_address = metrics_address
        self.registry = registry
        self.exposure = exposure
        # The exposure's interceptors first: a call without the API key is refused before its bytes are read.
        self.server = grpc.aio.server(options=SERVER_OPTIONS,
                                      interceptors=[*exposure.interceptors, UndecodableRequestInterceptor()])
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._metrics_http = None

    async def start(self) -> None:
        for spec in self._specs:
            spec.add_to_server(spec.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if self.exposure.reflection_on(self._address):
            reflection.enable_server_reflection([*self._service_names, health.SERVICE_NAME, reflection.SERVICE_NAME],
                                                self.server)
        tls = self.exposure.tls
        if tls is None:
            self.port = self.server.add_insecure_port(self._address)
            if not is_loopback(self._address):
                log.warning("%s: serving plaintext on %s, reachable from other machines; give it --tls-cert and "
                            "--tls-key (and --tls-ca for mutual TLS)", self.name, self._address)
        else:
            self.port = self.server.add_secure_port(
                self._address, tls.server_credentials(self.exposure.require_client_cert))
        if self.port == 0:
            raise RuntimeError(f"{self.name}: cannot listen on {self._address}")
        if self._metrics_address:
            host, _, port = self._metrics_address.rpartition(":")
            self._metrics_http, _ = start_http_server(int(port), addr=host or "127.0.0.1", registry=self.registry)
            self.metrics_port = self._metrics_http.server_port
        await self.server.start()
        await self.set_serving(True)
        await self.health.set(LIVENESS, SERVING)
        log.info("%s listening on %s (metrics on :%s)", self.name, self.grpc_address, self.metrics_port)

    @property
    def _service_names(self) -> list[str]:
        return [spec.full_name for spec in self._specs]

    async def set_serving(self, serving: bool) -> None:
        """What grpc.health.v1 reports for the server ("") and each of its services."""
        for full_name in ["", *self._service_names]:
            await self.health.set(full_name, SERVING if serving else NOT_SERVING)

    def banner(self) -> str:
        """Where it listens, as `specd serve` prints it when it is up."""
        metrics = f"http://127.0.0.1:{self.metrics_port}/metrics" if self.metrics_port else "off"
        return f"{self.name} listening on {self.grpc_address} metrics {metrics}"

    @property
    def grpc_address(self) -> str:
        host = self._address.rpartition(":")[0]
        return f"{host}:{self.port}"

    async def stop(self, grace: float = defaults.SHUTDOWN_GRACE_S) -> None:
        """Report NOT_SERVING, refuse new calls, let in-flight ones finish for up to `grace` seconds."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        if self._metrics_http is not None:
            self._metrics_http.shutdown()


def freeze_startup_objects() -> None:
    """Take everything alive now out of the garbage collector's sight for good (vLLM does the same): what a
    service builds at start-up lives until it stops, and every full collection would walk all of it again.
    The trie drafter's warm corpus is ~1.6M objects, a full collection over it 0.4-1.3 s on the 2-core
    EPYC, each one an ask missed. Reference counting still frees what is dropped."""
    gc.collect()
    gc.freeze()


async def serve_until_signalled(service: Service, grace: float = defaults.SHUTDOWN_GRACE_S) -> None:
    """Start `service`, print where it listens, and stop gracefully on SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await service.start()
    freeze_startup_objects()
    print(service.banner(), flush=True)
    await stop.wait()
    log.info("%s: shutting down; in-flight streams have %g s to finish", service.name, grace)
    await service.stop(grace)
