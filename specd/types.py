"""Domain types shared by the services, with their protobuf conversion.

Protobuf messages are converted to these dataclasses only at a service's edge;
everything inside a service works on the dataclasses.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from specd.errors import InvalidArgument, check_length
from specd.limits import MAX_CORPUS_SCOPE_CHARS
from specd.options import OptionSchema, OptionValue, options_from_pb, options_to_pb
from specd.v1 import common_pb2

MAX_SPECULATIVE_TOKENS = 64  # a draft tree of 16-64 nodes is worth verifying where verification is cheap
MAX_TOP_LOGPROBS = 20  # as OpenAI's top_logprobs
# Below this a temperature is greedy: dividing logits by it overflows (vLLM uses the same bound).
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 0  # 0: the server default
    logprobs: int | None = None  # report each token's logprob and this many top ones; None: none

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise InvalidArgument("sampling.temperature", f"must be finite and >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:  # also rejects NaN
            raise InvalidArgument("sampling.top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgument("sampling.top_k", f"must be >= 0, got {self.top_k}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise InvalidArgument("sampling.repetition_penalty",
                                  f"must be finite and > 0, got {self.repetition_penalty}")
        if self.max_tokens < 0:
            raise InvalidArgument("sampling.max_tokens", f"must be >= 0, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument("sampling.logprobs", f"must be in 0..{MAX_TOP_LOGPROBS}, got {self.logprobs}")

    @classmethod
    def from_pb(cls, pb: common_pb2.SamplingParams) -> SamplingParams:
        return cls(
            temperature=pb.temperature,
            top_p=pb.top_p or 1.0,  # proto3 default 0 means "off"
            top_k=pb.top_k,
            repetition_penalty=pb.repetition_penalty or 1.0,
            seed=pb.seed if pb.HasField("seed") else None,
            max_tokens=pb.max_tokens,
            logprobs=pb.logprobs if pb.HasField("logprobs") else None,
        )

    def to_pb(self) -> common_pb2.SamplingParams:
        pb = common_pb2.SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                       repetition_penalty=self.repetition_penalty, max_tokens=self.max_tokens)
        if self.seed is not None:
            pb.seed = self.seed
        if self.logprobs is not None:
            pb.logprobs = self.logprobs
        return pb


NO_SPECULATION = "none"
# "none" is a method of every deployment, and it takes no options.
NONE_SCHEMA = OptionSchema(NO_SPECULATION)
AUTO_METHOD = "auto"  # the target picks among the deployment's drafters, per sequence and step


def default_method(served: Iterable[str]) -> str:
    """The method of a deployment not told one: `auto` where it has drafters to choose among, else its
    first drafter (one that drafts from the target's features, which `auto` leaves out), else none."""
    served = list(served)
    if AUTO_METHOD in served:
        return AUTO_METHOD
    return next((method for method in served if method != NO_SPECULATION), NO_SPECULATION)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM-style speculative_config: the method, the most draft tokens per step, and the method's own
    options by their flat names. A deployment's config holds defaults for any method's options; a
    request's resolved config holds exactly its method's options. A deployment's method left empty is
    `default_method` of what it serves."""

    method: str = ""
    num_speculative_tokens: int = 8
    options: Mapping[str, OptionValue] = field(default_factory=dict)
    corpus_scope: str = ""  # which requests' outputs the learning drafters draft this one from ("": everyone's)

    @property
    def speculates(self) -> bool:
        return self.method != NO_SPECULATION and self.num_speculative_tokens > 0

    def resolve(self, request: common_pb2.SpeculativeConfig, schemas: Mapping[str, OptionSchema]) -> SpeculativeConfig:
        """A request's config: the fields it sets over this deployment default, its method's options
        checked (and completed) by that method's own schema."""
        method = request.method or self.method or default_method(schemas)
        schema = schemas.get(method)
        if schema is None:
            raise InvalidArgument("speculative.method",
                                  f"unknown method {method!r}; this deployment serves {', '.join(schemas)}")
        k = request.num_speculative_tokens if request.HasField("num_speculative_tokens") else \
            self.num_speculative_tokens
        if not 0 <= k <= MAX_SPECULATIVE_TOKENS:
            raise InvalidArgument("speculative.num_speculative_tokens",
                                  f"must be in 0..{MAX_SPECULATIVE_TOKENS}, got {k}")
        check_length("speculative.corpus_scope", request.corpus_scope, MAX_CORPUS_SCOPE_CHARS, "characters")
        return SpeculativeConfig(method, k, schema.resolve({**self._defaults_for(schema),
                                                            **options_from_pb(request.options)}),
                                 request.corpus_scope)

    def check_as_default(self, schemas: Mapping[str, OptionSchema]) -> None:
        """A deployment default must resolve, and its options must suit the methods that declare them."""
        self.resolve(common_pb2.SpeculativeConfig(), schemas)
        for schema in schemas.values():
            schema.resolve(self._defaults_for(schema))

    def _defaults_for(self, schema: OptionSchema) -> dict[str, OptionValue]:
        """This (deployment) config's options that `schema`'s method declares."""
        declared = {option.name for option in schema.options}
        return {name: value for name, value in self.options.items() if name in declared}

    def to_pb(self) -> common_pb2.SpeculativeConfig:
        return common_pb2.SpeculativeConfig(method=self.method, num_speculative_tokens=self.num_speculative_tokens,
                                            options=options_to_pb(self.options), corpus_scope=self.corpus_scope)


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log probability, and the likeliest (token id, log probability) pairs there."""
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_pb(self) -> common_pb2.TokenLogprobs:
        return common_pb2.TokenLogprobs(logprob=self.logprob, top_token_ids=[t for t, _ in self.top],
                                        top_logprobs=[lp for _, lp in self.top])


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    verification_steps: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    def to_pb(self) -> common_pb2.Usage:
        return common_pb2.Usage(**vars(self))

    @classmethod
    def from_pb(cls, pb: common_pb2.Usage) -> Usage:
        return cls(pb.prompt_tokens, pb.completion_tokens, pb.verification_steps, pb.draft_tokens,
                   pb.accepted_draft_tokens)


FinishReason = common_pb2.FinishReason
FINISH_REASON_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_STOP_STRING: "stop_string",
}
