"""Builds and runs the gateway: the tokenizer, a channel to the target, the Generation service."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from gateway.http.app import build_app
from gateway.http.server import HttpServer
from gateway.metrics import GatewayMetrics
from gateway.pipeline import GenerationPipeline, method_schemas
from gateway.servicer import GenerationServicer
from gateway.tokenizer import Tokenizer
from specd.health import UpstreamHealth
from specd.rpc import balanced_channel
from specd import defaults
from specd.security import ApiKeyInterceptor, TlsConfig
from specd.serving import Exposure, Service, ServiceSpec, serve_until_signalled
from specd.types import SpeculativeConfig
from specd.v1 import generation_pb2, generation_pb2_grpc, target_pb2, target_pb2_grpc

log = logging.getLogger(__name__)

# The target loads its model before it answers; give it that long.
TARGET_STARTUP_TIMEOUT_S = 60.0


class GatewayService(Service):
    """The gRPC server, the OpenAI-compatible HTTP server beside it (unless http_address is None), and
    their channel to the target; reports NOT_SERVING while the target is down. Both APIs take the same
    TLS certificate (clients need none of their own) and, if there is one, the same API key."""

    def __init__(self, tokenizer: Tokenizer, target_channel: grpc.aio.Channel, target_address: str,
                 model_info: target_pb2.ModelInfo, default_speculative: SpeculativeConfig, upstream_timeout_s: float,
                 address: str, metrics_address: str | None, http_address: str | None = None, *,
                 tls: TlsConfig | None = None, api_key: str | None = None, reflection: bool | None = None):
        self.metrics = GatewayMetrics()
        self._target_channel = target_channel
        self._target_health = UpstreamHealth(f"target at {target_address}", target_channel, self.set_serving)
        self.pipeline = GenerationPipeline(tokenizer, target_pb2_grpc.TargetStub(target_channel), self._target_health,
                                           model_info, default_speculative, self.metrics, upstream_timeout_s)
        spec = ServiceSpec(generation_pb2_grpc.add_GenerationServicer_to_server,
                           GenerationServicer(self.pipeline, self.metrics),
                           generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name)
        exposure = Exposure(tls=tls, require_client_cert=False, reflection=reflection,
                            interceptors=(ApiKeyInterceptor(api_key),) if api_key else ())
        super().__init__("gateway", [spec], address, metrics_address, self.metrics.registry, exposure)
        self.http = (HttpServer(build_app(self.pipeline, self.metrics), http_address, tls, api_key)
                     if http_address else None)

    async def start(self) -> None:
        await super().start()
        if self.http is not None:
            await self.http.start()
        self._target_health.start()

    def banner(self) -> str:
        return super().banner() + (f" http {self.http.url}" if self.http is not None else "")

    async def stop(self, grace: float = defaults.SHUTDOWN_GRACE_S) -> None:
        await self._target_health.stop()
        # Both APIs drain at once: in-flight streams get `grace` in all, not once per protocol.
        await asyncio.gather(super().stop(grace), *([self.http.stop(grace)] if self.http is not None else []))
        self.pipeline.close()
        await self._target_channel.close()


async def create_service(model: str, target_address: str, address: str = defaults.GATEWAY_ADDRESS,
                         metrics_address: str | None = defaults.GATEWAY_METRICS_ADDRESS,
                         default_speculative: SpeculativeConfig = SpeculativeConfig(),
                         upstream_timeout_s: float = defaults.UPSTREAM_TIMEOUT_S,
                         http_address: str | None = None, *, tls: TlsConfig | None = None, api_key: str | None = None,
                         reflection: bool | None = None) -> GatewayService:
    """A gateway for `model`'s tokenizer in front of the target at `target_address`, not yet started;
    with an HTTP API on `http_address` if one is given. With `tls`, both APIs are served over TLS and the
    target is reached over mutual TLS; with `api_key`, both APIs refuse calls that do not carry it."""
    tokenizer = await asyncio.to_thread(Tokenizer.load, model)
    channel = balanced_channel(target_address, tls)  # over every target replica the address resolves to
    try:
        model_info = await fetch_model_info(target_pb2_grpc.TargetStub(channel), target_address,
                                            TARGET_STARTUP_TIMEOUT_S)
        # Checked once here: a default the target cannot serve would fail every request.
        default_speculative.check_as_default(method_schemas(model_info))
    except BaseException:
        await channel.close()
        raise
    return GatewayService(tokenizer, channel, target_address, model_info, default_speculative, upstream_timeout_s,
                          address, metrics_address, http_address, tls=tls, api_key=api_key, reflection=reflection)


async def serve(model: str, target_address: str, address: str = defaults.GATEWAY_ADDRESS,
                metrics_address: str | None = defaults.GATEWAY_METRICS_ADDRESS,
                default_speculative: SpeculativeConfig = SpeculativeConfig(),
                upstream_timeout_s: float = defaults.UPSTREAM_TIMEOUT_S,
                http_address: str | None = defaults.GATEWAY_HTTP_ADDRESS,
                grace: float = defaults.SHUTDOWN_GRACE_S, **security) -> None:
    """`security`: create_service's tls, api_key and reflection."""
    service = await create_service(model, target_address, address, metrics_address, default_speculative,
                                   upstream_timeout_s, http_address, **security)
    await serve_until_signalled(service, grace)


async def fetch_model_info(target: target_pb2_grpc.TargetStub, target_address: str,
                           timeout_s: float) -> target_pb2.ModelInfo:
    """The target's ModelInfo, waiting up to timeout_s for it to come up and answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            # wait_for_ready: a target not listening yet is waited for until the deadline, not an error.
            return await target.GetModelInfo(target_pb2.ModelInfoRequest(), wait_for_ready=True,
                                             timeout=max(deadline - time.monotonic(), 0.01))
        except grpc.aio.AioRpcError as error:
            # UNAVAILABLE with a deadline left: the target is up but not serving yet; ask again.
            if error.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() + 1.0 > deadline:
                raise RuntimeError(f"target at {target_address} did not answer GetModelInfo within "
                                   f"{timeout_s:g} s: {error.code().name} {error.details()}") from error
        log.info("waiting for the target at %s", target_address)
        await asyncio.sleep(1.0)
