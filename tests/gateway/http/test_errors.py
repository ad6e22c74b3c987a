"""Errors reach HTTP clients in OpenAI's form, with the status a gRPC client's code stands for."""
import grpc
import pytest

from gateway.http.errors import HttpError, http_field
from gateway.pipeline import UpstreamError
from specd.errors import InvalidArgument, ResourceExhausted, Unavailable


@pytest.mark.parametrize("specd_field, http_name", [
    ("sampling.temperature", "temperature"), ("chat.messages[2].role", "messages[2].role"),
    ("speculative.method", "speculative_config.method"),
    ("speculative.options.prompt_lookup_max", "speculative_config.prompt_lookup_max"), ("prompt", "prompt")])
def test_fields_are_named_as_the_http_request_names_them(specd_field, http_name):
    assert http_field(specd_field) == http_name


def test_an_invalid_argument_is_a_400_naming_the_field():
    error = HttpError.of(InvalidArgument("sampling.top_p", "must be in (0, 1], got 2"))
    assert (error.status, error.param, error.message) == (400, "top_p", "top_p: must be in (0, 1], got 2")
    assert error.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("error, status", [(ResourceExhausted("queue full"), 429), (Unavailable("down"), 503)])
def test_domain_errors_take_their_http_status(error, status):
    assert HttpError.of(error).status == status


class _RpcError(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def test_the_targets_invalid_argument_names_the_http_field():
    error = HttpError.of(UpstreamError(_RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                                                 "sampling.max_tokens: must be >= 0")))
    assert (error.status, error.param) == (400, "max_tokens")


@pytest.mark.parametrize("code, status", [(grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
                                          (grpc.StatusCode.UNAVAILABLE, 503),
                                          (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
                                          (grpc.StatusCode.INTERNAL, 500)])
def test_the_targets_status_codes_map_to_http(code, status):
    assert HttpError.of(UpstreamError(_RpcError(code, "why"))).status == status


def test_anything_else_is_a_bug_and_propagates():
    with pytest.raises(KeyError):
        HttpError.of(KeyError("x"))
