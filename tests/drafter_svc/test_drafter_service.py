"""The drafter as a real gRPC service on 127.0.0.1, driven through the generated stub."""
import asyncio
import contextlib
import signal
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from drafter_svc.sequences import SequenceRegistry
from drafter_svc.servicer import DEFERRED_TOKENS
from drafter_svc.server import create_service
from specd.options import options_to_pb
from specd.limits import (MAX_CORPUS_SCOPE_CHARS, MAX_DRAFTER_SEQUENCE_TOKENS, MAX_PROPOSE_SEQUENCES,
                          MAX_PROPOSE_TOKENS, MAX_RELEASE_SEQUENCES, MAX_SEQUENCE_ID_CHARS)
from specd.types import MAX_SPECULATIVE_TOKENS
from specd.v1 import drafter_pb2, drafter_pb2_grpc

LOOPING_PROMPT = [11, 12, 13, 14, 15, 16] * 4  # the lookup always finds a match in it
VOCAB_SIZE = 49152  # the target's, sent with every ask
REPO_ROOT = Path(__file__).resolve().parents[2]


async def started(metrics_address=None, method="ngram", proposer_args=None):
    service = create_service(method, address="127.0.0.1:0", metrics_address=metrics_address,
                             proposer_args=proposer_args)
    await service.start()
    return service


@pytest.fixture
async def drafter():
    # no /metrics endpoint here: stopping its HTTP server takes half a second
    service = await started()
    yield service
    await service.stop(grace=0)


@pytest.fixture
async def channel(drafter):
    async with grpc.aio.insecure_channel(drafter.grpc_address) as channel:
        yield channel


@pytest.fixture
def stub(channel):
    return drafter_pb2_grpc.DrafterStub(channel)


def params(k=4, min_n=2, max_n=4, **options):
    return dict(max_draft_tokens=k, options=options_to_pb(dict(prompt_lookup_min=min_n, prompt_lookup_max=max_n,
                                                              **options)))


def update(sequence_id, start, tokens, draft_params=None):
    return drafter_pb2.SequenceUpdate(sequence_id=sequence_id, start_position=start, appended_token_ids=tokens,
                                      **(draft_params or params()))


async def propose(stub, *updates):
    return (await stub.Propose(drafter_pb2.ProposeRequest(sequences=updates, vocab_size=VOCAB_SIZE))).drafts


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


LONG_PROMPT = [20 + i % 50 for i in range(DEFERRED_TOKENS)] + LOOPING_PROMPT  # more than a model drafter takes in time


@contextlib.asynccontextmanager
async def serving(method, proposer_args=None):
    """A stub of a started `method` drafter service, stopped after."""
    service = await started(method=method, proposer_args=proposer_args)
    try:
        async with grpc.aio.insecure_channel(service.grpc_address) as channel:
            yield drafter_pb2_grpc.DrafterStub(channel)
    finally:
        await service.stop(grace=0)


@pytest.mark.parametrize("method", ["ngram", "suffix", "trie"])
async def test_a_text_drafter_drafts_from_a_long_first_update_at_once(method):
    async with serving(method) as stub:
        defaults = dict(max_draft_tokens=4)  # each method on its own options
        (draft,) = await propose(stub, update("long", 0, LONG_PROMPT, defaults))
    assert list(draft.token_ids)[:3] == [11, 12, 13]


@pytest.mark.parametrize("method", ["suffix", "trie"])
async def test_a_learning_drafter_drafts_from_the_outputs_of_its_first_updates_corpus_scope_only(method):
    prompt, output = [1, 2, 3], [60, 61, 62, 63, 64]

    def first(sequence_id, tokens, scope, prompt_length=1):
        return drafter_pb2.SequenceUpdate(sequence_id=sequence_id, appended_token_ids=tokens, max_draft_tokens=4,
                                          prompt_length=prompt_length, corpus_scope=scope)
    async with serving(method, {"warm_outputs": []}) as stub:
        await propose(stub, first("done", [*prompt, *output], "alice", prompt_length=len(prompt)))
        await stub.Release(drafter_pb2.ReleaseRequest(sequence_ids=["done"]))
        same, other = await propose(stub, first("same", [9, 60, 61], "alice"), first("other", [9, 60, 61], "bob"))
        (later,) = await propose(stub, drafter_pb2.SequenceUpdate(  # later updates leave the scope out
            sequence_id="same", start_position=3, appended_token_ids=[62], max_draft_tokens=4))
    assert list(same.token_ids)[:2] == [62, 63] and list(later.token_ids)[:2] == [63, 64]
    assert not other.token_ids


async def test_a_model_drafter_takes_a_long_first_update_in_after_its_answer_and_drafts_at_the_next_ask(
        tiny_model_dir):
    chains = dict(max_draft_tokens=4, options=options_to_pb({"min_token_prob": 0.0}))
    async with serving("draft_model", {"model": str(tiny_model_dir), "kv_cache_tokens": 1024}) as stub:
        first = await propose(stub, update("long", 0, LONG_PROMPT, chains), update("short", 0, LOOPING_PROMPT, chains))
        assert [len(d.token_ids) for d in first] == [0, 4]  # the short one is not held up
        assert not first[0].resync_needed
        (then,) = await propose(stub, update("long", len(LONG_PROMPT), [11]))
    assert len(then.token_ids) == 4


async def test_the_propose_stream_answers_each_request_in_order_as_propose_does(stub):
    steps = [[update("loop", 0, LOOPING_PROMPT)], [update("loop", len(LOOPING_PROMPT), [11, 12, 13])],
             [update("loop", len(LOOPING_PROMPT) + 3, [14]), update("fresh", 0, [1, 2, 3])]]
    stream = stub.ProposeStream()
    answers = []
    for updates in steps:
        await stream.write(drafter_pb2.ProposeRequest(sequences=updates, vocab_size=VOCAB_SIZE))
        answers.append(list((await stream.read()).drafts))
    await stream.done_writing()
    assert await stream.read() is grpc.aio.EOF
    assert [[list(d.token_ids) for d in drafts] for drafts in answers] == [[[11, 12, 13, 14]], [[14, 15, 16, 11]],
                                                                          [[15, 16, 11, 12], []]]


async def test_an_invalid_request_ends_the_propose_stream_naming_the_field(stub):
    stream = stub.ProposeStream()
    too_many = params(k=MAX_SPECULATIVE_TOKENS + 1)
    await stream.write(drafter_pb2.ProposeRequest(sequences=[update("ok", 0, LOOPING_PROMPT, too_many)],
                                                  vocab_size=VOCAB_SIZE))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stream.read()
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sequences[0].max_draft_tokens" in error.value.details()
    (draft,) = await propose(stub, update("ok", 0, LOOPING_PROMPT))  # the next call is served
    assert list(draft.token_ids) == [11, 12, 13, 14]


async def test_a_restarted_drafter_asks_for_the_whole_sequence_again(stub):
    await propose(stub, update("loop", 0, LOOPING_PROMPT))
    restarted = await started()
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
    pytest.param(update("x", 0, [1], params(k=MAX_SPECULATIVE_TOKENS + 1)), "sequences[1].max_draft_tokens",
                 id="k>max"),
    pytest.param(update("x", 0, [1], params(k=-1)), "sequences[1].max_draft_tokens", id="k<0"),
    pytest.param(update("x", 0, [1], params(min_n=0)), "sequences[1].options.prompt_lookup_min", id="min<1"),
    pytest.param(update("x", 0, [1], params(min_n=3, max_n=2)), "sequences[1].options.prompt_lookup_max",
                 id="max<min"),
    pytest.param(update("x", 0, [1], params(telepathy=1)), "sequences[1].options.telepathy", id="unknown-option"),
    pytest.param(update("x", -1, [1]), "sequences[1].start_position", id="negative-start"),
    pytest.param(update("", 0, [1]), "sequences[1].sequence_id", id="empty-id"),
    pytest.param(update("ok", 0, [1]), "sequences[1].sequence_id", id="same-id-twice"),
    pytest.param(update("x", 0, [1, VOCAB_SIZE]), "sequences[1].appended_token_ids[1]", id="token-past-vocab"),
    pytest.param(update("x", 0, [-1]), "sequences[1].appended_token_ids[0]", id="negative-token"),
])
async def test_invalid_entries_are_rejected_naming_the_field(stub, bad_entry, field):
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await propose(stub, update("ok", 0, LOOPING_PROMPT), bad_entry)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in error.value.details()
    # nothing of the rejected request was applied
    (draft,) = await propose(stub, update("ok", len(LOOPING_PROMPT), [11]))
    assert draft.resync_needed


@pytest.mark.parametrize("request_of, field", [
    pytest.param(lambda: [update(str(i), 0, [1]) for i in range(MAX_PROPOSE_SEQUENCES + 1)], "sequences",
                 id="too-many-sequences"),
    pytest.param(lambda: [update("x" * (MAX_SEQUENCE_ID_CHARS + 1), 0, [1])], "sequences[0].sequence_id",
                 id="long-id"),
    pytest.param(lambda: [drafter_pb2.SequenceUpdate(sequence_id="x", appended_token_ids=[1],
                                                     corpus_scope="x" * (MAX_CORPUS_SCOPE_CHARS + 1))],
                 "sequences[0].corpus_scope", id="long-scope"),
    pytest.param(lambda: [update("x", MAX_DRAFTER_SEQUENCE_TOKENS, [1])], "sequences[0].appended_token_ids",
                 id="sequence-too-long"),
    pytest.param(lambda: [update(str(i), 0, [1] * (MAX_PROPOSE_TOKENS // 2)) for i in range(3)], "sequences",
                 id="too-many-tokens-in-all"),
])
async def test_every_size_is_bounded(stub, request_of, field):
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await propose(stub, *request_of())
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith(field + ":")


@pytest.mark.parametrize("vocab_size", [0, -5])
async def test_an_ask_without_the_vocabulary_size_is_refused(stub, vocab_size):
    """Token ids are checked against the target's vocabulary, so an ask must say how large it is."""
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.Propose(drafter_pb2.ProposeRequest(sequences=[update("s", 0, [1])], vocab_size=vocab_size))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith("vocab_size:")


async def test_release_of_too_many_sequences_is_refused(stub):
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.Release(drafter_pb2.ReleaseRequest(sequence_ids=["s"] * (MAX_RELEASE_SEQUENCES + 1)))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sequence_ids" in error.value.details()


async def test_sequences_never_released_are_evicted_and_the_state_size_is_exported():
    drafter = create_service(address="127.0.0.1:0", metrics_address="127.0.0.1:0",
                             sequences=SequenceRegistry(max_sequences=2))
    await drafter.start()
    try:
        async with grpc.aio.insecure_channel(drafter.grpc_address) as channel:
            stub = drafter_pb2_grpc.DrafterStub(channel)
            for name in ("a", "b", "c"):
                await propose(stub, update(name, 0, LOOPING_PROMPT))
        metrics = await asyncio.to_thread(scrape, drafter.metrics_port)
    finally:
        await drafter.stop(grace=0)
    assert metrics[("specd_drafter_sequences", ())] == 2
    assert metrics[("specd_drafter_tokens_held", ())] == 2 * len(LOOPING_PROMPT)
    assert metrics[("specd_drafter_evictions_total", (("reason", "capacity"),))] == 1


async def test_a_sequences_options_from_its_first_update_hold_for_the_later_ones(stub):
    only_single_tokens_repeat = [7, 1, 2, 8, 9, 7]
    (draft,) = await propose(stub, update("s", 0, only_single_tokens_repeat, params(min_n=1)))
    assert list(draft.token_ids)[:1] == [1]
    later = drafter_pb2.SequenceUpdate(sequence_id="s", start_position=6, appended_token_ids=[4, 7],
                                       max_draft_tokens=4)  # no options: prompt_lookup_min stays 1, not 2
    (draft,) = await propose(stub, later)
    assert list(draft.token_ids)[:1] == [4]  # only the single token 7 recurs


async def test_describe_tells_the_method_and_its_options(stub):
    info = await stub.Describe(drafter_pb2.DescribeRequest())
    assert info.method == "ngram"
    assert [(o.name, o.type, o.default_value.number_value) for o in info.options] == \
        [("prompt_lookup_min", "int", 2), ("prompt_lookup_max", "int", 5)]


async def test_drafts_are_trees_with_an_estimate_per_token(stub):
    (draft,) = await propose(stub, update("loop", 0, LOOPING_PROMPT))
    assert list(draft.parent_ids) == list(range(-1, len(draft.token_ids) - 1))
    assert len(draft.probs) == len(draft.token_ids) and all(0 < p <= 1 for p in draft.probs)


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


async def test_metrics_endpoint_counts_what_the_drafter_did():
    drafter = await started(metrics_address="127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(drafter.grpc_address) as channel:
            stub = drafter_pb2_grpc.DrafterStub(channel)
            await propose(stub, update("loop", 0, LOOPING_PROMPT), update("fresh", 0, [1, 2, 3]))
            await propose(stub, update("loop", len(LOOPING_PROMPT), [11]), update("lost", 9, [1]))
            await stub.Release(drafter_pb2.ReleaseRequest(sequence_ids=["fresh"]))
        metrics = await asyncio.to_thread(scrape, drafter.metrics_port)
    finally:
        await drafter.stop(grace=0)
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


async def test_serve_runs_until_sigterm_then_exits_cleanly():
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import asyncio; from drafter_svc.server import serve; "
                              "asyncio.run(serve(address='127.0.0.1:0', metrics_address=None))",
        cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE)
    try:
        banner = (await asyncio.wait_for(process.stdout.readline(), timeout=10)).decode()
        address = banner.split(" listening on ")[1].split()[0]
        async with grpc.aio.insecure_channel(address) as channel:
            # an answer also means serve() got past installing its signal handlers
            response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert response.status == health_pb2.HealthCheckResponse.SERVING
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), timeout=10) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
