"""Checks of a GenerateRequest; each failure names the offending field. Every check here is cheap
and runs before the prompt is tokenized, so an oversized request costs the gateway nothing."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specd.errors import InvalidArgument, check_length
from specd.limits import MAX_CHAT_MESSAGES, MAX_REQUEST_ID_CHARS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from specd.options import OptionSchema
from specd.types import SamplingParams, SpeculativeConfig
from specd.v1 import generation_pb2

CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class GenerationOptions:
    """Everything in a request besides its input, validated."""
    sampling: SamplingParams
    speculative: SpeculativeConfig
    stop: tuple[str, ...]


def validate_request(request: generation_pb2.GenerateRequest, default_speculative: SpeculativeConfig,
                     schemas: Mapping[str, OptionSchema], max_prompt_chars: int) -> GenerationOptions:
    """Everything that can be checked before tokenizing; the speculative config is the deployment's
    default with the request's fields on top, checked by the served methods' own `schemas`.
    `max_prompt_chars`: longer input cannot fit the context whatever it tokenizes to."""
    check_length("request_id", request.request_id, MAX_REQUEST_ID_CHARS, "characters")
    check_input(request, max_prompt_chars)
    sampling = SamplingParams.from_pb(request.sampling)
    sampling.validate()
    speculative = default_speculative.resolve(request.speculative, schemas)
    return GenerationOptions(sampling, speculative, check_stop_strings(request.stop))


def check_input(request: generation_pb2.GenerateRequest, max_prompt_chars: int) -> None:
    if request.WhichOneof("input") != "chat":
        if not request.prompt:
            raise InvalidArgument("prompt", "must not be empty (or send chat.messages instead)")
        _check_prompt_chars("prompt", len(request.prompt), max_prompt_chars)
        return
    messages = request.chat.messages
    if not messages:
        raise InvalidArgument("chat.messages", "must not be empty")
    check_length("chat.messages", messages, MAX_CHAT_MESSAGES)
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise InvalidArgument(f"chat.messages[{i}].role",
                                  f"unknown role {message.role!r}; use one of {', '.join(CHAT_ROLES)}")
    _check_prompt_chars("chat.messages", sum(len(m.content) for m in messages), max_prompt_chars)


def _check_prompt_chars(input_field: str, num_chars: int, max_prompt_chars: int) -> None:
    if num_chars > max_prompt_chars:
        raise InvalidArgument(input_field, f"too long: {num_chars} characters cannot fit the model's context "
                                           f"(at most {max_prompt_chars})")


def check_stop_strings(stop: Sequence[str]) -> tuple[str, ...]:
    check_length("stop", stop, MAX_STOP_STRINGS, "stop strings")
    for i, stop_string in enumerate(stop):
        if not stop_string:
            raise InvalidArgument(f"stop[{i}]", "must not be empty")
        check_length(f"stop[{i}]", stop_string, MAX_STOP_STRING_CHARS, "characters")
    return tuple(stop)


def check_prompt_fits(input_field: str, num_tokens: int, max_context_length: int) -> None:
    """The prompt must leave room for at least one generated token. A max_tokens reaching past the
    context is no error: the target clips it and finishes with LENGTH at the context's end."""
    if num_tokens >= max_context_length:
        raise InvalidArgument(input_field, f"too long: {num_tokens} tokens, the context holds {max_context_length}")
