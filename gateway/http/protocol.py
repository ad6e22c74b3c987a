"""OpenAI's request bodies for /v1/chat/completions and /v1/completions, as pydantic models, and
their translation to specd's GenerateRequest. Validation of values (ranges, lengths) stays in one
place, the pipeline's; here only what OpenAI's API has and specd does not is refused, by name."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from specd.errors import InvalidArgument
from specd.types import MAX_TOP_LOGPROBS
from specd.v1 import common_pb2, generation_pb2

# OpenAI's defaults where they differ from specd's gRPC API (greedy when unset).
OPENAI_DEFAULT_TEMPERATURE = 1.0
# OpenAI's newer role for system instructions.
ROLE_ALIASES = {"developer": "system"}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    """The fields both endpoints share. Unknown fields are ignored, as OpenAI-compatible servers do;
    known ones specd cannot honour are refused rather than ignored."""
    model_config = ConfigDict(extra="allow")

    model: str
    temperature: float | None = Field(None, description="default 1.0, as OpenAI's; 0 is greedy")
    top_p: float | None = None
    top_k: int | None = Field(None, description="vLLM's extension; 0 or -1 is off")
    repetition_penalty: float | None = Field(None, description="vLLM's extension; 1 is off")
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool = Field(False, description="vLLM's extension: each choice carries its token ids")
    speculative_config: dict[str, Any] | None = Field(
        None, description="specd's per-request speculation in vLLM's flat keys: method, num_speculative_tokens, "
                          "corpus_scope (only requests of the same scope draft from each other's outputs) and the "
                          "method's own options (e.g. prompt_lookup_max)")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def top_logprobs_asked(self) -> int | None:
        """How many top logprobs each token reports; None: no logprobs at all."""
        raise NotImplementedError

    def _to_request(self, max_tokens: int | None) -> generation_pb2.GenerateRequest:
        self._refuse_unsupported()
        sampling = common_pb2.SamplingParams(
            temperature=OPENAI_DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),  # vLLM's -1 and specd's 0 both mean off
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            max_tokens=max_tokens or 0)
        if self.top_logprobs_asked is not None:
            sampling.logprobs = self.top_logprobs_asked
        if self.seed is not None:
            if self.seed < 0:
                raise InvalidArgument("seed", f"must be >= 0, got {self.seed}")
            sampling.seed = self.seed
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return generation_pb2.GenerateRequest(sampling=sampling, stop=stop,
                                              speculative=_speculative(self.speculative_config or {}))

    def _refuse_unsupported(self) -> None:
        if self.n != 1:
            raise InvalidArgument("n", f"only 1 choice per request is supported, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise InvalidArgument(name, "not supported (use repetition_penalty)")
        if self.logit_bias:
            raise InvalidArgument("logit_bias", "not supported")


def _speculative(config: dict[str, Any]) -> common_pb2.SpeculativeConfig:
    """vLLM's flat speculative_config keys onto specd's SpeculativeConfig (method, budget, options)."""
    options = dict(config)
    method = options.pop("method", "")
    if not isinstance(method, str):
        raise InvalidArgument("speculative_config.method", f"must be a string, got {method!r}")
    scope = options.pop("corpus_scope", "")
    if not isinstance(scope, str):
        raise InvalidArgument("speculative_config.corpus_scope", f"must be a string, got {scope!r}")
    pb = common_pb2.SpeculativeConfig(method=method, corpus_scope=scope)
    if "num_speculative_tokens" in options:
        k = options.pop("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool):
            raise InvalidArgument("speculative_config.num_speculative_tokens", f"must be an integer, got {k!r}")
        pb.num_speculative_tokens = k
    try:
        pb.options.update(options)
    except (TypeError, ValueError) as error:
        raise InvalidArgument("speculative_config", f"option values must be numbers, bools or strings: {error}")
    return pb


class TextPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, and the like: not used

    role: str
    content: str | list[TextPart] | None = None

    def text(self, index: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for j, part in enumerate(self.content):
            if part.type != "text":
                raise InvalidArgument(f"messages[{index}].content[{j}].type",
                                      f"only text parts are supported, got {part.type!r}")
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    @property
    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def to_request(self) -> generation_pb2.GenerateRequest:
        if self.top_logprobs and not self.logprobs:
            raise InvalidArgument("top_logprobs", "needs logprobs: true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument("top_logprobs", f"must be in 0..{MAX_TOP_LOGPROBS}, got {self.top_logprobs}")
        if self.tools:
            raise InvalidArgument("tools", "tool calling is not supported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise InvalidArgument("response_format", "only the text format is supported")
        request = self._to_request(self.max_completion_tokens if self.max_completion_tokens is not None
                                   else self.max_tokens)
        request.chat.messages.extend(
            generation_pb2.ChatMessage(role=ROLE_ALIASES.get(message.role, message.role), content=message.text(i))
            for i, message in enumerate(self.messages))
        if not self.messages:  # an empty oneof would read as an empty prompt
            raise InvalidArgument("messages", "must not be empty")
        return request


class CompletionRequest(_Request):
    prompt: str | list[str]
    max_tokens: int | None = 16  # OpenAI's default for completions (chat's is the rest of the context)
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @property
    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    def to_request(self) -> generation_pb2.GenerateRequest:
        for name in ("echo", "suffix"):
            if getattr(self, name):
                raise InvalidArgument(name, "not supported")
        if self.best_of not in (None, 1):
            raise InvalidArgument("best_of", f"only 1 is supported, got {self.best_of}")
        prompt = self.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise InvalidArgument("prompt", f"one prompt per request is supported, got {len(prompt)}")
            prompt = prompt[0]
        request = self._to_request(self.max_tokens)
        request.prompt = prompt
        return request

