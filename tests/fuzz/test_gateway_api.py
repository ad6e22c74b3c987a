"""The public Generation API under hostile requests: every call streams text or ends with a clear status
naming the field, and the gateway (and the target behind it) then serves the next well-formed request."""
import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from specd.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.fuzz.hostile import (SIZES, assert_clear, assert_raw_answered_or_refused, assert_serving, channel_to, mostly,
                                raw_requests, read_some, sampling_params, speculative_configs, texts)

SERVICE = "specd.v1.Generation"
ROLES = mostly(st.sampled_from(["system", "user", "assistant"]), texts())
CHAT_MESSAGES = st.builds(generation_pb2.ChatMessage, role=ROLES, content=texts())
# Many of one short message (one of megabytes, repeated, would be more memory than the machine has).
SHORT_MESSAGES = st.builds(generation_pb2.ChatMessage, role=st.text(max_size=10), content=st.text(max_size=8))
CHATS = st.one_of(st.lists(CHAT_MESSAGES, max_size=5), st.tuples(SHORT_MESSAGES, SIZES).map(lambda t: [t[0]] * t[1]))


@st.composite
def generate_requests(draw) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(
        sampling=draw(sampling_params()), speculative=draw(speculative_configs()),
        stop=draw(mostly(st.lists(texts(8), max_size=2), st.lists(texts(), max_size=20))),
        request_id=draw(texts(300)))
    input_kind = draw(st.sampled_from(["prompt", "chat", "none"]))
    if input_kind == "prompt":
        request.prompt = draw(texts())
    elif input_kind == "chat":
        request.chat.messages.extend(draw(CHATS))
    return request


GENERATE_REQUESTS = generate_requests()


@pytest.fixture(scope="module")
def channel(gateway):
    with channel_to(gateway.grpc_address) as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(channel):
    return generation_pb2_grpc.GenerationStub(channel)


def assert_serves_the_next_request(channel, stub) -> None:
    assert_serving(channel, SERVICE)
    request = generation_pb2.GenerateRequest(prompt="One, two, three",
                                             sampling=common_pb2.SamplingParams(max_tokens=2))
    responses = list(stub.Generate(request))
    assert responses[-1].finish_reason and responses[-1].usage.completion_tokens == 2


@given(request=GENERATE_REQUESTS)
def test_a_hostile_generate_streams_text_or_is_refused_naming_the_field(channel, stub, request):
    try:
        for response in read_some(stub.Generate(request)):
            assert len(response.logprobs) in (0, len(response.token_ids))
    except grpc.RpcError as error:
        assert_clear(error, request.DESCRIPTOR)
    assert_serves_the_next_request(channel, stub)


@given(raw=raw_requests(GENERATE_REQUESTS))
def test_raw_bytes_at_generate_are_answered_or_refused(channel, stub, raw):
    assert_raw_answered_or_refused(channel, f"/{SERVICE}/Generate", "unary_stream",
                                   generation_pb2.GenerateRequest.DESCRIPTOR, raw)
    assert_serves_the_next_request(channel, stub)
