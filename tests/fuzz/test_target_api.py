"""The Target API under hostile requests: every call streams tokens of the vocabulary or ends with a clear
status naming the field, and the target then serves the next well-formed request (its scheduler loop, which
every request shares, survived)."""
import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from specd.v1 import common_pb2, target_pb2, target_pb2_grpc
from tests.fuzz.hostile import (VOCAB_SIZE, assert_clear, assert_raw_answered_or_refused, assert_serving, channel_to,
                                raw_requests, read_some, sampling_params, speculative_configs, texts, token_id_lists)

SERVICE = "specd.v1.Target"


GENERATE_REQUESTS = st.builds(target_pb2.TargetGenerateRequest, request_id=texts(300),
                              prompt_token_ids=token_id_lists(), sampling=sampling_params(),
                              speculative=speculative_configs())
# Each method: how it is called, its request type, and requests to damage.
METHODS = {"Generate": ("unary_stream", target_pb2.TargetGenerateRequest, GENERATE_REQUESTS),
           "GetModelInfo": ("unary_unary", target_pb2.ModelInfoRequest, st.just(target_pb2.ModelInfoRequest()))}


@pytest.fixture(scope="module")
def channel(target):
    with channel_to(target.grpc_address) as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(channel):
    return target_pb2_grpc.TargetStub(channel)


def assert_serves_the_next_request(channel, stub) -> None:
    assert_serving(channel, SERVICE)
    request = target_pb2.TargetGenerateRequest(prompt_token_ids=[5, 6, 7, 5, 6, 7],
                                               sampling=common_pb2.SamplingParams(max_tokens=2))
    chunks = list(stub.Generate(request))
    assert chunks[-1].finish_reason and chunks[-1].usage.completion_tokens == 2


@given(request=GENERATE_REQUESTS)
def test_a_hostile_generate_streams_tokens_or_is_refused_naming_the_field(channel, stub, request):
    try:
        for chunk in read_some(stub.Generate(request)):
            assert all(0 <= t < VOCAB_SIZE for t in chunk.token_ids)
            assert len(chunk.logprobs) in (0, len(chunk.token_ids))
    except grpc.RpcError as error:
        assert_clear(error, request.DESCRIPTOR)
    assert_serves_the_next_request(channel, stub)


@given(data=st.data(), method=st.sampled_from(sorted(METHODS)))
def test_raw_bytes_at_any_target_method_are_answered_or_refused(channel, stub, data, method):
    kind, request_type, messages = METHODS[method]
    raw = data.draw(raw_requests(messages), label="raw")
    assert_raw_answered_or_refused(channel, f"/{SERVICE}/{method}", kind, request_type.DESCRIPTOR, raw)
    assert_serves_the_next_request(channel, stub)
