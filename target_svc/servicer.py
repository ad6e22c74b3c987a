"""The Target gRPC service: a thin shell over the scheduler."""
from __future__ import annotations

import logging
import uuid
from typing import Callable

from specd.rpc import rpc_handler
from specd.errors import InvalidArgument, check_length
from specd.limits import MAX_REQUEST_ID_CHARS
from specd.options import OptionSchema
from specd.types import SamplingParams, SpeculativeConfig
from specd.v1 import target_pb2, target_pb2_grpc
from target_svc.metrics import TargetMetrics
from target_svc.scheduler import Scheduler
from target_svc.sequence import Sequence, StepOutput

log = logging.getLogger(__name__)


class TargetServicer(target_pb2_grpc.TargetServicer):
    def __init__(self, scheduler: Scheduler, model_info: target_pb2.ModelInfo,
                 default_speculative: SpeculativeConfig, metrics: TargetMetrics):
        self._scheduler = scheduler
        self._info = model_info
        self._default_speculative = default_speculative
        self._schemas_of: Callable[[], dict[str, OptionSchema]] = dict
        self.rpc_metrics = metrics.rpc_metrics

    def serve_methods(self, schemas_of: Callable[[], dict[str, OptionSchema]]) -> None:
        """The methods the deployment serves and their options as they are now (a drafter that was
        down at start describes its options later); the deployment's default must suit them."""
        schemas = schemas_of()
        self._default_speculative.check_as_default(schemas)
        self._schemas_of = schemas_of
        self._info.methods[:] = list(schemas)

    @rpc_handler
    async def Generate(self, request: target_pb2.TargetGenerateRequest, context):
        seq = self._sequence_of(request)
        self._scheduler.submit(seq)
        try:
            while True:
                out = await seq.outputs.get()
                if isinstance(out, Exception):
                    raise out
                yield _to_pb(out)
                if out.finish_reason:
                    return
        finally:
            # Finished sequences are gone already; a cancelled one is dropped at the next step.
            self._scheduler.abort(seq)

    @rpc_handler
    async def GetModelInfo(self, request, context):
        info = target_pb2.ModelInfo()
        info.CopyFrom(self._info)
        info.method_info.extend(schema.to_pb() for schema in self._schemas_of().values())  # as known now
        return info

    def _sequence_of(self, request: target_pb2.TargetGenerateRequest) -> Sequence:
        check_length("request_id", request.request_id, MAX_REQUEST_ID_CHARS, "characters")
        prompt = list(request.prompt_token_ids)
        context_len = self._info.max_context_length
        if not prompt:
            raise InvalidArgument("prompt_token_ids", "must not be empty")
        if len(prompt) >= context_len:
            raise InvalidArgument("prompt_token_ids", f"{len(prompt)} tokens; the context holds {context_len}")
        if not all(0 <= t < self._info.vocab_size for t in prompt):
            raise InvalidArgument("prompt_token_ids", f"token ids must be in 0..{self._info.vocab_size - 1}")
        sampling = SamplingParams.from_pb(request.sampling)
        sampling.validate()
        speculative = self._default_speculative.resolve(request.speculative, self._schemas_of())
        max_tokens = min(sampling.max_tokens or self._info.default_max_tokens, context_len - len(prompt))
        # A fresh internal id: callers' ids need not be unique (KV block tables' must be), and only
        # this short one travels to the drafters every step.
        seq_id = uuid.uuid4().hex
        log.debug("request %r is sequence %s", request.request_id, seq_id)
        return Sequence(seq_id, prompt, sampling, speculative, max_tokens,
                        frozenset(self._info.eos_token_ids))


def _to_pb(out: StepOutput) -> target_pb2.TargetGenerateResponse:
    return target_pb2.TargetGenerateResponse(token_ids=out.token_ids, accepted_draft_tokens=out.accepted_draft_tokens,
                                             finish_reason=out.finish_reason, usage=out.usage.to_pb(),
                                             logprobs=[lp.to_pb() for lp in out.logprobs])
