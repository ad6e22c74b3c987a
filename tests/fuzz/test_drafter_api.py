"""The Drafter API under hostile requests: every call is answered OK (a draft per sequence, every token in the
vocabulary) or with a clear status naming the field, and the drafter then serves the target's next ask."""
import math

import grpc
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from specd.drafts import DraftTree
from specd.options import options_to_pb
from specd.v1 import drafter_pb2, drafter_pb2_grpc
from tests.fuzz.hostile import (VOCAB_SIZE, assert_clear, assert_raw_answered_or_refused, assert_serving, channel_to,
                                int32s, mostly, option_structs, raw_requests, small_or_hostile_ints, texts,
                                token_id_lists)

SERVICE = "specd.v1.Drafter"
SEQUENCE_IDS = mostly(st.sampled_from(["a", "b", "c"]), texts(70))  # few: later updates find earlier ones
FEATURES = st.builds(drafter_pb2.Features, start_position=int32s(), hidden_size=int32s(),
                     dtype=st.sampled_from(["bfloat16", "float16", "float32", "int8", ""]),
                     data=st.binary(max_size=64))


@st.composite
def sequence_updates(draw) -> drafter_pb2.SequenceUpdate:
    update = drafter_pb2.SequenceUpdate(
        sequence_id=draw(SEQUENCE_IDS), start_position=draw(mostly(st.sampled_from([0, 3, 40]), int32s())),
        appended_token_ids=draw(token_id_lists()), max_draft_tokens=draw(small_or_hostile_ints(8)),
        prompt_length=draw(small_or_hostile_ints(40)))
    if draw(st.booleans()):
        update.options.CopyFrom(draw(option_structs(["prompt_lookup_min", "prompt_lookup_max"])))
    if draw(mostly(st.just(False), st.just(True))):
        update.features.CopyFrom(draw(FEATURES))
    return update


PROPOSE_REQUESTS = st.builds(drafter_pb2.ProposeRequest, sequences=st.lists(sequence_updates(), max_size=4),
                             vocab_size=mostly(st.just(VOCAB_SIZE), int32s()))
RELEASE_REQUESTS = st.builds(drafter_pb2.ReleaseRequest, sequence_ids=st.lists(SEQUENCE_IDS, max_size=6))
# Each method: how it is called, its request type, and requests to damage.
METHODS = {"Propose": ("unary_unary", drafter_pb2.ProposeRequest, PROPOSE_REQUESTS),
           "ProposeStream": ("stream_stream", drafter_pb2.ProposeRequest, PROPOSE_REQUESTS),
           "Release": ("unary_unary", drafter_pb2.ReleaseRequest, RELEASE_REQUESTS),
           "Describe": ("unary_unary", drafter_pb2.DescribeRequest, st.just(drafter_pb2.DescribeRequest()))}


@pytest.fixture(scope="module")
def channel(drafter):
    with channel_to(drafter.grpc_address) as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(channel):
    return drafter_pb2_grpc.DrafterStub(channel)


def assert_answers(request: drafter_pb2.ProposeRequest, response: drafter_pb2.ProposeResponse) -> None:
    """One draft per sequence in request order, each a well-formed tree of tokens in the vocabulary."""
    assert [d.sequence_id for d in response.drafts] == [u.sequence_id for u in request.sequences]
    for draft in response.drafts:
        DraftTree.from_pb(draft).validate("draft")
        assert all(0 <= t < request.vocab_size for t in draft.token_ids)


def assert_serves_the_next_ask(channel, stub) -> None:
    assert_serving(channel, SERVICE)
    ask = drafter_pb2.ProposeRequest(vocab_size=VOCAB_SIZE, sequences=[drafter_pb2.SequenceUpdate(
        sequence_id="well-formed", appended_token_ids=[11, 12, 13, 11, 12], max_draft_tokens=4)])
    (draft,) = stub.Propose(ask).drafts
    assert list(draft.token_ids)[:1] == [13]  # the n-gram lookup still works


def ask(**update) -> drafter_pb2.ProposeRequest:
    """A new sequence's first update, as the target sends it, with `update`'s fields over it."""
    fields = {"sequence_id": "s", "appended_token_ids": [1, 2, 1], "max_draft_tokens": 2, **update}
    return drafter_pb2.ProposeRequest(vocab_size=VOCAB_SIZE, sequences=[drafter_pb2.SequenceUpdate(**fields)])


@given(request=PROPOSE_REQUESTS)
@example(request=ask(options=options_to_pb({"prompt_lookup_min": math.nan})))  # was INTERNAL
@example(request=ask(appended_token_ids=[1, VOCAB_SIZE]))
def test_a_hostile_propose_is_answered_or_refused_naming_the_field(channel, stub, request):
    try:
        assert_answers(request, stub.Propose(request))
    except grpc.RpcError as error:
        assert_clear(error, request.DESCRIPTOR)
    assert_serves_the_next_ask(channel, stub)


@given(requests=st.lists(PROPOSE_REQUESTS, min_size=1, max_size=3))
def test_hostile_asks_on_the_propose_stream_are_answered_in_order_until_one_is_refused(channel, stub, requests):
    answered = 0
    try:
        for response in stub.ProposeStream(iter(requests)):
            assert_answers(requests[answered], response)
            answered += 1
    except grpc.RpcError as error:
        assert_clear(error, drafter_pb2.ProposeRequest.DESCRIPTOR)
    assert_serves_the_next_ask(channel, stub)


@given(request=RELEASE_REQUESTS)
def test_a_hostile_release_is_done_or_refused_naming_the_field(channel, stub, request):
    try:
        stub.Release(request)
    except grpc.RpcError as error:
        assert_clear(error, request.DESCRIPTOR)
    assert_serves_the_next_ask(channel, stub)


@given(data=st.data(), method=st.sampled_from(sorted(METHODS)))
def test_raw_bytes_at_any_drafter_method_are_answered_or_refused(channel, stub, data, method):
    kind, request_type, messages = METHODS[method]
    raw = data.draw(raw_requests(messages), label="raw")
    assert_raw_answered_or_refused(channel, f"/{SERVICE}/{method}", kind, request_type.DESCRIPTOR, raw)
    assert_serves_the_next_ask(channel, stub)
