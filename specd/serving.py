"""What every specd service shares at its edge: the gRPC server bootstrap
(health, reflection, graceful shutdown on SIGTERM), the Prometheus endpoint,
and the mapping of domain errors to gRPC status codes."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from specd.types import InvalidArgument

log = logging.getLogger(__name__)


class ResourceExhausted(RuntimeError):
    """The server cannot take this request now (queue full, KV cache too small)."""


_STATUS_OF = {InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT, ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED}


class RpcMetrics:
    """Handled RPCs by method and status code, and their duration."""

    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter("specd_rpc_requests", "RPCs handled by this service, by method and gRPC status code",
                                ["rpc_method", "code"], registry=registry)
        self.duration = Histogram("specd_rpc_duration_seconds",
                                  "Seconds this service spent on one RPC, a whole stream included",
                                  ["rpc_method"], registry=registry,
                                  buckets=(.001, .005, .01, .05, .1, .5, 1, 2.5, 5, 10, 30, 60, 120))

    def observe(self, method: str, code: grpc.StatusCode, started: float) -> None:
        self.requests.labels(method, code.name).inc()
        self.duration.labels(method).observe(time.perf_counter() - started)


@contextlib.asynccontextmanager
async def _rpc_scope(metrics: RpcMetrics, method: str, context: grpc.aio.ServicerContext):
    """Maps domain errors to gRPC status codes and counts the call by its final code."""
    started, code = time.perf_counter(), grpc.StatusCode.OK
    try:
        yield
    except tuple(_STATUS_OF) as exc:
        code = _STATUS_OF[type(exc)]
        await context.abort(code, str(exc))
    except asyncio.CancelledError:
        code = grpc.StatusCode.CANCELLED
        raise
    except Exception:  # context.abort() raises too; then the context holds its code
        code = context.code() or grpc.StatusCode.INTERNAL
        raise
    finally:
        metrics.observe(method, code, started)


def rpc_handler(func: Callable) -> Callable:
    """Wrap a servicer method (coroutine or async generator) in `_rpc_scope`, with the
    servicer's `rpc_metrics`."""
    if inspect.isasyncgenfunction(func):
        @functools.wraps(func)
        async def stream_wrapper(self, request, context):
            async with _rpc_scope(self.rpc_metrics, func.__name__, context):
                async for item in func(self, request, context):
                    yield item
        return stream_wrapper

    @functools.wraps(func)
    async def unary_wrapper(self, request, context):
        async with _rpc_scope(self.rpc_metrics, func.__name__, context):
            return await func(self, request, context)
    return unary_wrapper


@dataclass
class ServiceSpec:
    """One gRPC service to host: its `add_XServicer_to_server` function, servicer and full name."""
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    servicer: Any
    full_name: str


class Service:
    """A started gRPC server plus its /metrics endpoint."""

    def __init__(self, name: str, specs: list[ServiceSpec], address: str, metrics_address: str | None,
                 registry: CollectorRegistry):
        self.name = name
        self._specs = specs
        self._address = address
        self._metrics_address = metrics_address
        self._registry = registry
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._metrics_http = None

    async def start(self) -> None:
        for spec in self._specs:
            spec.add_to_server(spec.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [s.full_name for s in self._specs]
        reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        self.port = self.server.add_insecure_port(self._address)
        if self.port == 0:
            raise RuntimeError(f"{self.name}: cannot listen on {self._address}")
        if self._metrics_address:
            host, _, port = self._metrics_address.rpartition(":")
            self._metrics_http, _ = start_http_server(int(port), addr=host or "127.0.0.1", registry=self._registry)
            self.metrics_port = self._metrics_http.server_port
        await self.server.start()
        for full_name in ["", *names]:
            await self.health.set(full_name, health_pb2.HealthCheckResponse.SERVING)
        log.info("%s listening on %s (metrics on :%s)", self.name, self.grpc_address, self.metrics_port)

    @property
    def grpc_address(self) -> str:
        host = self._address.rpartition(":")[0]
        return f"{host}:{self.port}"

    async def stop(self, grace: float = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        if self._metrics_http is not None:
            self._metrics_http.shutdown()


async def serve_until_signalled(service: Service, on_stop: Callable[[], Any] | None = None,
                                grace: float = 5.0) -> None:
    """Start `service`, print where it listens, and stop gracefully on SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await service.start()
    metrics = f"http://127.0.0.1:{service.metrics_port}/metrics" if service.metrics_port else "off"
    print(f"{service.name} listening on {service.grpc_address} metrics {metrics}", flush=True)
    await stop.wait()
    log.info("%s: shutting down", service.name)
    await service.stop(grace)
    if on_stop is not None:
        result = on_stop()
        if inspect.isawaitable(result):
            await result
