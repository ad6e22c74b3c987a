"""Checks of a GenerateRequest; each failure names the offending field."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specd.types import InvalidArgument, SamplingParams, SpeculativeConfig
from specd.v1 import generation_pb2

CHAT_ROLES = ("system", "user", "assistant")
MAX_STOP_STRINGS = 16


@dataclass(frozen=True)
class GenerationOptions:
    """Everything in a request besides its input, validated."""
    sampling: SamplingParams
    speculative: SpeculativeConfig
    stop: tuple[str, ...]


def validate_request(request: generation_pb2.GenerateRequest, default_speculative: SpeculativeConfig,
                     served_methods: Sequence[str]) -> GenerationOptions:
    """Everything that can be checked before tokenizing; the speculative config is the deployment's
    default with the request's fields on top."""
    check_input(request)
    sampling = SamplingParams.from_pb(request.sampling)
    sampling.validate()
    speculative = default_speculative.merged_with(request.speculative)
    speculative.validate(list(served_methods))
    return GenerationOptions(sampling, speculative, check_stop_strings(request.stop))


def check_input(request: generation_pb2.GenerateRequest) -> None:
    if request.WhichOneof("input") != "chat":
        if not request.prompt:
            raise InvalidArgument("prompt", "must not be empty (or send chat.messages instead)")
        return
    if not request.chat.messages:
        raise InvalidArgument("chat.messages", "must not be empty")
    for i, message in enumerate(request.chat.messages):
        if message.role not in CHAT_ROLES:
            raise InvalidArgument(f"chat.messages[{i}].role",
                                  f"unknown role {message.role!r}; use one of {', '.join(CHAT_ROLES)}")


def check_stop_strings(stop: Sequence[str]) -> tuple[str, ...]:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidArgument("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    for i, stop_string in enumerate(stop):
        if not stop_string:
            raise InvalidArgument(f"stop[{i}]", "must not be empty")
    return tuple(stop)


def check_prompt_fits(input_field: str, num_tokens: int, max_context_length: int) -> None:
    """The prompt must leave room for at least one generated token. A max_tokens reaching past the
    context is no error: the target clips it and finishes with LENGTH at the context's end."""
    if num_tokens >= max_context_length:
        raise InvalidArgument(input_field, f"too long: {num_tokens} tokens, the context holds {max_context_length}")
