"""One request through the gateway, whichever protocol it came in on: validate, tokenize, relay to
the target, stream text deltas back. The gRPC and the HTTP edges both drive this."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
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
from specd.types import FINISH_REASON_NAMES, SpeculativeConfig
from specd.v1 import common_pb2, generation_pb2, target_pb2, target_pb2_grpc

log = logging.getLogger(__name__)

# What gRPC says when a call's own deadline passes; a DEADLINE_EXCEEDED the target sends says why itself
# (a step stuck past its --step-timeout).
_DEADLINE_PASSED = "Deadline Exceeded"


class UpstreamError(Exception):
    """The target ended the request with a status; the edges pass it on (INVALID_ARGUMENT stays
    INVALID_ARGUMENT, not INTERNAL)."""

    def __init__(self, error: grpc.aio.AioRpcError):
        self.code = error.code()
        details = error.details() or ""
        if self.code == grpc.StatusCode.UNAVAILABLE:
            details = f"target service unavailable: {details}"
        elif self.code == grpc.StatusCode.DEADLINE_EXCEEDED and details == _DEADLINE_PASSED:
            details = ("the request did not finish within its deadline (the client's, or the gateway's "
                       "--upstream-timeout)")
        super().__init__(details)
        self.details = details


class GenerationPipeline:
    def __init__(self, tokenizer: Tokenizer, target_stub: target_pb2_grpc.TargetStub, target_health: UpstreamHealth,
                 model_info: target_pb2.ModelInfo, default_speculative: SpeculativeConfig, metrics: GatewayMetrics,
                 upstream_timeout_s: float):
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.target_health = target_health
        self._target = target_stub
        self._max_prompt_chars = model_info.max_context_length * tokenizer.max_token_chars
        self._schemas = method_schemas(model_info)
        self._default_speculative = default_speculative
        self._metrics = metrics
        self._upstream_timeout_s = upstream_timeout_s
        # Prompts are tokenized one at a time, off the event loop: a burst of long prompts then
        # takes one core, not all of them from the target and the streams in flight.
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    async def generate(self, request: generation_pb2.GenerateRequest,
                       client_time_remaining: float | None = None) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """The response chunks of `request`; raises a domain error (specd.errors) for a request the
        gateway refuses and UpstreamError for one the target ends. Closing the iterator early (a
        client gone, a stop string) cancels the request at the target."""
        started = time.perf_counter()
        options = validate_request(request, self._default_speculative, self._schemas, self._max_prompt_chars)
        if not self.target_health.serving:  # fail now rather than wait on a target known to be down
            raise Unavailable(f"target service unavailable: {self.target_health.last_problem}")
        prompt_token_ids = await self._encode(request)
        upstream = self._target.Generate(_target_request(request, prompt_token_ids, options),
                                         timeout=self._upstream_timeout(client_time_remaining))
        observer = self._metrics.observe_request(len(prompt_token_ids), started)
        responses = _ResponseStream(self.tokenizer, options.stop, observer)
        with self._metrics.requests_running.track_inprogress():
            try:
                async for chunk in upstream:
                    response = await asyncio.to_thread(responses.respond, chunk)  # detokenizing, off the loop
                    yield response
                    if response.finish_reason:
                        break
            except grpc.aio.AioRpcError as error:
                raise UpstreamError(error) from None
            finally:
                upstream.cancel()  # the client left or a stop string matched; a no-op if the target finished

    def close(self) -> None:
        self._encoder.shutdown(wait=False)

    def _upstream_timeout(self, client_time_remaining: float | None) -> float:
        """The gateway's own bound on a request, or less when the client's deadline comes sooner."""
        if client_time_remaining is None:
            return self._upstream_timeout_s
        return min(self._upstream_timeout_s, client_time_remaining)

    async def _encode(self, request: generation_pb2.GenerateRequest) -> list[int]:
        """Prompt token ids, tokenized off the event loop (long prompts take milliseconds)."""
        loop = asyncio.get_running_loop()
        if request.WhichOneof("input") == "chat":
            messages = [(message.role, message.content) for message in request.chat.messages]
            token_ids = await loop.run_in_executor(self._encoder, self.tokenizer.encode_chat, messages)
            input_field = "chat.messages"
        else:
            token_ids = await loop.run_in_executor(self._encoder, self.tokenizer.encode_prompt, request.prompt)
            input_field = "prompt"
        check_prompt_fits(input_field, len(token_ids), self.model_info.max_context_length)
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
                                                   accepted_draft_tokens=chunk.accepted_draft_tokens,
                                                   logprobs=chunk.logprobs)
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
