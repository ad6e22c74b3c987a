"""The public Generation service: validate, tokenize, relay to the target, stream text deltas."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc

from gateway.detokenizer import IncrementalDetokenizer
from gateway.metrics import GatewayMetrics, RequestObserver
from gateway.stop_strings import StopStringMatcher
from gateway.tokenizer import Tokenizer
from gateway.validation import GenerationOptions, check_prompt_fits, validate_request
from specd.errors import Unavailable
from specd.health import UpstreamHealth
from specd.options import OptionSchema
from specd.rpc import rpc_handler
from specd.types import FINISH_REASON_NAMES, SpeculativeConfig
from specd.v1 import common_pb2, generation_pb2, generation_pb2_grpc, target_pb2, target_pb2_grpc

log = logging.getLogger(__name__)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, tokenizer: Tokenizer, target_stub: target_pb2_grpc.TargetStub, target_health: UpstreamHealth,
                 model_info: target_pb2.ModelInfo, default_speculative: SpeculativeConfig, metrics: GatewayMetrics,
                 upstream_timeout_s: float):
        self._tokenizer = tokenizer
        self._target = target_stub
        self._target_health = target_health
        self._model_info = model_info
        self._max_prompt_chars = model_info.max_context_length * tokenizer.max_token_chars
        self._schemas = method_schemas(model_info)
        self._default_speculative = default_speculative
        self._metrics = metrics
        self._upstream_timeout_s = upstream_timeout_s
        self.rpc_metrics = metrics.rpc_metrics
        # Prompts are tokenized one at a time, off the event loop: a burst of long prompts then
        # takes one core, not all of them from the target and the streams in flight.
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    @rpc_handler
    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        started = time.perf_counter()
        options = validate_request(request, self._default_speculative, self._schemas, self._max_prompt_chars)
        if not self._target_health.serving:  # fail now rather than wait on a target known to be down
            raise Unavailable(f"target service unavailable: {self._target_health.last_problem}")
        prompt_token_ids = await self._encode(request)
        upstream = self._target.Generate(_target_request(request, prompt_token_ids, options),
                                         timeout=self._upstream_timeout(context))
        # However this RPC ends (client cancel included), the target must free the sequence.
        context.add_done_callback(lambda _: upstream.cancel())
        observer = self._metrics.observe_request(len(prompt_token_ids), started)
        responses = _ResponseStream(self._tokenizer, options.stop, observer)
        with self._metrics.requests_running.track_inprogress():
            try:
                async for chunk in upstream:
                    response = await asyncio.to_thread(responses.respond, chunk)  # detokenizing, off the loop
                    yield response
                    if response.finish_reason:
                        break
            except grpc.aio.AioRpcError as error:
                await _abort_like(context, error)
            finally:
                upstream.cancel()  # a stop string ended the stream early; a no-op if the target finished

    def close(self) -> None:
        self._encoder.shutdown(wait=False)

    def _upstream_timeout(self, context: grpc.aio.ServicerContext) -> float:
        """The gateway's own bound on a request, or less when the client's deadline comes sooner."""
        client_remaining = context.time_remaining()
        return self._upstream_timeout_s if client_remaining is None else min(self._upstream_timeout_s,
                                                                              client_remaining)

    async def _encode(self, request: generation_pb2.GenerateRequest) -> list[int]:
        """Prompt token ids, tokenized off the event loop (long prompts take milliseconds)."""
        loop = asyncio.get_running_loop()
        if request.WhichOneof("input") == "chat":
            messages = [(message.role, message.content) for message in request.chat.messages]
            token_ids = await loop.run_in_executor(self._encoder, self._tokenizer.encode_chat, messages)
            input_field = "chat.messages"
        else:
            token_ids = await loop.run_in_executor(self._encoder, self._tokenizer.encode_prompt, request.prompt)
            input_field = "prompt"
        check_prompt_fits(input_field, len(token_ids), self._model_info.max_context_length)
        return token_ids


def method_schemas(model_info: target_pb2.ModelInfo) -> dict[str, OptionSchema]:
    """The options of every method the target serves, as the methods declare them."""
    return {info.method: OptionSchema.from_pb(info) for info in model_info.method_info}


def _target_request(request: generation_pb2.GenerateRequest, prompt_token_ids: list[int],
                    options: GenerationOptions) -> target_pb2.TargetGenerateRequest:
    request_id = request.request_id or uuid.uuid4().hex
    log.debug("request %s: %d prompt tokens, %s", request_id, len(prompt_token_ids), options.speculative)
    return target_pb2.TargetGenerateRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                            sampling=options.sampling.to_pb(),
                                            speculative=options.speculative.to_pb())


async def _abort_like(context: grpc.aio.ServicerContext, error: grpc.aio.AioRpcError) -> None:
    """End this RPC with the target's status, so callers see INVALID_ARGUMENT etc., not INTERNAL."""
    details = error.details() or ""
    if error.code() == grpc.StatusCode.UNAVAILABLE:
        details = f"target service unavailable: {details}"
    elif error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        details = "the request did not finish within its deadline (the client's, or the gateway's --upstream-timeout)"
    await context.abort(error.code(), details)


class _ResponseStream:
    """Target chunks in, client chunks out: text deltas cut at the first stop string, and the
    finish reason and usage on the last one; observed in the gateway's metrics."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...], observer: RequestObserver):
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stop = StopStringMatcher(stop)
        self._observer = observer

    def respond(self, chunk: target_pb2.TargetGenerateResponse) -> generation_pb2.GenerateResponse:
        self._observer.on_chunk(len(chunk.token_ids))
        response = generation_pb2.GenerateResponse(text=self._text_of(chunk), token_ids=chunk.token_ids,
                                                   accepted_draft_tokens=chunk.accepted_draft_tokens)
        if self._stop.matched or chunk.finish_reason:
            response.finish_reason = common_pb2.FINISH_REASON_STOP_STRING if self._stop.matched else chunk.finish_reason
            response.usage.CopyFrom(chunk.usage)  # the target's running totals, up to this chunk
            self._observer.on_finish(FINISH_REASON_NAMES[response.finish_reason])
        return response

    def _text_of(self, chunk: target_pb2.TargetGenerateResponse) -> str:
        text = self._detokenizer.add(chunk.token_ids)
        if chunk.finish_reason:
            text += self._detokenizer.flush()
        visible = self._stop.feed(text)
        if chunk.finish_reason and not self._stop.matched:
            visible += self._stop.finish()
        return visible
