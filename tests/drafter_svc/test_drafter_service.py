"""The drafter as a real gRPC service on 127.0.0.1, driven through the generated stub."""
import asyncio
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from drafter_svc.server import create_service
from specd.v1 import drafter_pb2, drafter_pb2_grpc

LOOPING_PROMPT = [11, 12, 13, 14, 15, 16] * 4  # the lookup always finds a match in it
PARAMS = drafter_pb2.DraftParams(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)


@pytest.fixture
async def drafter():
    service = create_service(address="127.0.0.1:0", metrics_address="127.0.0.1:0")
    await service.start()
    yield service
    await service.stop(grace=0)


@pytest.fixture
async def channel(drafter):
    async with grpc.aio.insecure_channel(drafter.grpc_address) as channel:
        yield channel


@pytest.fixture
def stub(channel):
    return drafter_pb2_grpc.DrafterStub(channel)


def update(sequence_id, start, tokens, params=PARAMS):
    return drafter_pb2.SequenceUpdate(sequence_id=sequence_id, start_position=start, appended_token_ids=tokens,
                                      params=params)


async def propose(stub, *updates):
    return (await stub.Propose(drafter_pb2.ProposeRequest(sequences=updates))).drafts


async def test_drafts_every_sequence_of_the_batch_in_request_order(stub):
    drafts = await propose(stub, update("loop", 0, LOOPING_PROMPT), update("fresh", 0, [1, 2, 3, 4]),
                           update("pair", 0, [7, 8, 9, 7, 8]))
    assert [d.sequence_id for d in drafts] == ["loop", "fresh", "pair"]
    assert list(drafts[0].token_ids) == [11, 12, 13, 14]
    assert list(drafts[1].token_ids) == []
    assert list(drafts[2].token_ids)[:1] == [9]
    assert not any(d.resync_needed for d in drafts)


async def test_keeps_drafting_from_incremental_updates(stub):
    await propose(stub, update("loop", 0, LOOPING_PROMPT))
    (draft,) = await propose(stub, update("loop", len(LOOPING_PROMPT), [11, 12, 13]))
    assert list(draft.token_ids)[:2] == [14, 15]


async def test_a_restarted_drafter_asks_for_the_whole_sequence_again(stub):
    await propose(stub, update("loop", 0, LOOPING_PROMPT))
    restarted = create_service(address="127.0.0.1:0", metrics_address=None)
    await restarted.start()
    try:
        async with grpc.aio.insecure_channel(restarted.grpc_address) as channel:
            restarted_stub = drafter_pb2_grpc.DrafterStub(channel)
            (draft,) = await propose(restarted_stub, update("loop", len(LOOPING_PROMPT), [11]))
            assert draft.resync_needed and list(draft.token_ids) == []
            (draft,) = await propose(restarted_stub, update("loop", 0, LOOPING_PROMPT + [11]))
            assert not draft.resync_needed and list(draft.token_ids)[:1] == [12]
    finally:
        await restarted.stop(grace=0)


async def test_release_forgets_sequences(stub):
    await propose(stub, update("a", 0, LOOPING_PROMPT), update("b", 0, LOOPING_PROMPT))
    await stub.Release(drafter_pb2.ReleaseRequest(sequence_ids=["a", "never-seen"]))
    drafts = await propose(stub, update("a", len(LOOPING_PROMPT), [11]), update("b", len(LOOPING_PROMPT), [11]))
    assert [d.resync_needed for d in drafts] == [True, False]


@pytest.mark.parametrize("bad_entry, field", [
    (update("x", 0, [1], drafter_pb2.DraftParams(num_speculative_tokens=17, prompt_lookup_min=1, prompt_lookup_max=2)),
     "sequences[1].params.num_speculative_tokens"),
    (update("x", 0, [1], drafter_pb2.DraftParams(num_speculative_tokens=-1, prompt_lookup_min=1, prompt_lookup_max=2)),
     "sequences[1].params.num_speculative_tokens"),
    (update("x", 0, [1], drafter_pb2.DraftParams(num_speculative_tokens=4, prompt_lookup_min=0, prompt_lookup_max=2)),
     "sequences[1].params.prompt_lookup_min"),
    (update("x", 0, [1], drafter_pb2.DraftParams(num_speculative_tokens=4, prompt_lookup_min=3, prompt_lookup_max=2)),
     "sequences[1].params.prompt_lookup_max"),
    (update("x", -1, [1]), "sequences[1].start_position"),
    (update("", 0, [1]), "sequences[1].sequence_id"),
    (update("ok", 0, [1]), "sequences[1].sequence_id"),  # the same id twice
])
async def test_invalid_entries_are_rejected_naming_the_field(stub, bad_entry, field):
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await propose(stub, update("ok", 0, LOOPING_PROMPT), bad_entry)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in error.value.details()
    # nothing of the rejected request was applied
    (draft,) = await propose(stub, update("ok", len(LOOPING_PROMPT), [11]))
    assert draft.resync_needed


async def test_health_check_reports_serving(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "specd.v1.Drafter"):
        response = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert response.status == health_pb2.HealthCheckResponse.SERVING


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


async def test_metrics_endpoint_counts_what_the_drafter_did(drafter, stub):
    await propose(stub, update("loop", 0, LOOPING_PROMPT), update("fresh", 0, [1, 2, 3]))
    await propose(stub, update("loop", len(LOOPING_PROMPT), [11]), update("lost", 9, [1]))
    await stub.Release(drafter_pb2.ReleaseRequest(sequence_ids=["fresh"]))
    metrics = await asyncio.to_thread(scrape, drafter.metrics_port)
    ngram = (("method", "ngram"),)
    assert metrics[("specd_drafter_proposals_total", ngram)] == 3
    assert metrics[("specd_drafter_empty_drafts_total", ngram)] == 1
    assert metrics[("specd_drafter_draft_tokens_total", ngram)] >= 2
    assert metrics[("specd_drafter_resyncs_total", ngram)] == 1
    assert metrics[("specd_drafter_propose_seconds_count", ngram)] == 2
    assert metrics[("specd_drafter_sequences", ())] == 1
    assert metrics[("specd_rpc_requests_total", (("code", "OK"), ("rpc_method", "Propose")))] == 2
    assert metrics[("specd_rpc_requests_total", (("code", "OK"), ("rpc_method", "Release")))] == 1


def test_an_unknown_method_is_refused():
    with pytest.raises(ValueError, match="ngram"):
        create_service(method="telepathy")
