"""Builds and runs the gateway: the tokenizer, a channel to the target, the Generation service."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from gateway.metrics import GatewayMetrics
from gateway.servicer import GenerationServicer, method_schemas
from gateway.tokenizer import Tokenizer
from specd.health import UpstreamHealth
from specd.rpc import insecure_channel
from specd import defaults
from specd.serving import Service, ServiceSpec, serve_until_signalled
from specd.types import SpeculativeConfig
from specd.v1 import generation_pb2, generation_pb2_grpc, target_pb2, target_pb2_grpc

log = logging.getLogger(__name__)

# The target loads its model before it answers; give it that long.
TARGET_STARTUP_TIMEOUT_S = 60.0


class GatewayService(Service):
    """The gRPC server plus its channel to the target; reports NOT_SERVING while the target is down."""

    def __init__(self, tokenizer: Tokenizer, target_channel: grpc.aio.Channel, target_address: str,
                 model_info: target_pb2.ModelInfo, default_speculative: SpeculativeConfig, upstream_timeout_s: float,
                 address: str, metrics_address: str | None):
        self.metrics = GatewayMetrics()
        self._target_channel = target_channel
        self._target_health = UpstreamHealth(f"target at {target_address}", target_channel, self.set_serving)
        self._servicer = GenerationServicer(tokenizer, target_pb2_grpc.TargetStub(target_channel), self._target_health,
                                            model_info, default_speculative, self.metrics, upstream_timeout_s)
        spec = ServiceSpec(generation_pb2_grpc.add_GenerationServicer_to_server, self._servicer,
                           generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name)
        super().__init__("gateway", [spec], address, metrics_address, self.metrics.registry)

    async def start(self) -> None:
        await super().start()
        self._target_health.start()

    async def stop(self, grace: float = defaults.SHUTDOWN_GRACE_S) -> None:
        await self._target_health.stop()
        await super().stop(grace)
        self._servicer.close()
        await self._target_channel.close()


async def create_service(model: str, target_address: str, address: str = defaults.GATEWAY_ADDRESS,
                         metrics_address: str | None = defaults.GATEWAY_METRICS_ADDRESS,
                         default_speculative: SpeculativeConfig = SpeculativeConfig(),
                         upstream_timeout_s: float = defaults.UPSTREAM_TIMEOUT_S) -> GatewayService:
    """A gateway for `model`'s tokenizer in front of the target at `target_address`, not yet started."""
    tokenizer = await asyncio.to_thread(Tokenizer.load, model)
    channel = insecure_channel(target_address)
    try:
        model_info = await fetch_model_info(target_pb2_grpc.TargetStub(channel), target_address,
                                            TARGET_STARTUP_TIMEOUT_S)
        # Checked once here: a default the target cannot serve would fail every request.
        default_speculative.check_as_default(method_schemas(model_info))
    except BaseException:
        await channel.close()
        raise
    return GatewayService(tokenizer, channel, target_address, model_info, default_speculative, upstream_timeout_s,
                          address, metrics_address)


async def serve(model: str, target_address: str, address: str = defaults.GATEWAY_ADDRESS,
                metrics_address: str | None = defaults.GATEWAY_METRICS_ADDRESS,
                default_speculative: SpeculativeConfig = SpeculativeConfig(),
                upstream_timeout_s: float = defaults.UPSTREAM_TIMEOUT_S,
                grace: float = defaults.SHUTDOWN_GRACE_S) -> None:
    service = await create_service(model, target_address, address, metrics_address, default_speculative,
                                   upstream_timeout_s)
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
