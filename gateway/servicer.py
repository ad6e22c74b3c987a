"""The public gRPC Generation service: the gRPC edge of the gateway's GenerationPipeline."""
from __future__ import annotations

import contextlib

import grpc

from gateway.metrics import GatewayMetrics
from gateway.pipeline import GenerationPipeline, UpstreamError
from specd.rpc import rpc_handler
from specd.v1 import generation_pb2, generation_pb2_grpc


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, pipeline: GenerationPipeline, metrics: GatewayMetrics):
        self._pipeline = pipeline
        self.rpc_metrics = metrics.rpc_metrics

    @rpc_handler
    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        # aclosing: however this RPC ends (client cancel included), the target frees the sequence now.
        async with contextlib.aclosing(self._pipeline.generate(request, context.time_remaining())) as responses:
            try:
                async for response in responses:
                    yield response
            except UpstreamError as error:
                await context.abort(error.code, error.details)
