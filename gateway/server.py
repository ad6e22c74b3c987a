"""Builds and runs the gateway: the tokenizer, a channel to the target, the Generation service."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from gateway.metrics import GatewayMetrics
from gateway.servicer import GenerationServicer
from gateway.tokenizer import Tokenizer
from specd.serving import Service, ServiceSpec, serve_until_signalled
from specd.types import SpeculativeConfig
from specd.v1 import generation_pb2, generation_pb2_grpc, target_pb2, target_pb2_grpc

log = logging.getLogger(__name__)

# The target loads its model before it answers; give it that long.
TARGET_STARTUP_TIMEOUT_S = 60.0


class GatewayService(Service):
    """The gRPC server plus its channel to the target, closed when the server stops."""

    def __init__(self, servicer: GenerationServicer, target_channel: grpc.aio.Channel, address: str,
                 metrics_address: str | None, metrics: GatewayMetrics):
        spec = ServiceSpec(generation_pb2_grpc.add_GenerationServicer_to_server, servicer,
                           generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name)
        super().__init__("gateway", [spec], address, metrics_address, metrics.registry)
        self.metrics = metrics
        self._target_channel = target_channel

    async def stop(self, grace: float = 5.0) -> None:
        await super().stop(grace)
        await self._target_channel.close()


async def create_service(model: str, target_address: str, address: str = "127.0.0.1:50051",
                         metrics_address: str | None = "127.0.0.1:9100",
                         default_speculative: SpeculativeConfig = SpeculativeConfig()) -> GatewayService:
    """A gateway for `model`'s tokenizer in front of the target at `target_address`, not yet started."""
    tokenizer = await asyncio.to_thread(Tokenizer.load, model)
    channel = grpc.aio.insecure_channel(target_address)
    try:
        target = target_pb2_grpc.TargetStub(channel)
        model_info = await fetch_model_info(target, target_address, TARGET_STARTUP_TIMEOUT_S)
        # Checked once here: a default the target cannot serve would fail every request.
        default_speculative.validate(list(model_info.methods))
    except BaseException:
        await channel.close()
        raise
    metrics = GatewayMetrics()
    servicer = GenerationServicer(tokenizer, target, model_info, default_speculative, metrics)
    return GatewayService(servicer, channel, address, metrics_address, metrics)


async def serve(model: str, target_address: str, address: str = "127.0.0.1:50051",
                metrics_address: str | None = "127.0.0.1:9100",
                default_speculative: SpeculativeConfig = SpeculativeConfig()) -> None:
    service = await create_service(model, target_address, address, metrics_address, default_speculative)
    await serve_until_signalled(service)


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
