"""The target's side of the drafter API (a drafter service as a draft source), against real drafter
services on loopback."""
import asyncio

import grpc
import pytest

from drafter_svc.sequences import SequenceRegistry
from drafter_svc.server import create_service as create_drafter
from specd.limits import MAX_DRAFTER_SEQUENCE_TOKENS, MAX_PROPOSE_TOKENS
from specd.options import options_to_pb
from specd.ports import free_ports
from specd.types import SamplingParams, SpeculativeConfig
from specd.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_svc.drafting.remote import RemoteDrafter
from target_svc.metrics import TargetMetrics
from target_svc.sequence import Sequence
from target_svc.server import TargetOptions, TargetService

LOOPING_PROMPT = [11, 12, 13, 14, 15, 16] * 4


NGRAM = SpeculativeConfig("ngram", 4, {"prompt_lookup_min": 2, "prompt_lookup_max": 5})


def sequence(name: str, prompt=LOOPING_PROMPT) -> Sequence:
    return Sequence(name, list(prompt), SamplingParams(), NGRAM, 16, frozenset())


@pytest.fixture
def address() -> str:
    return f"127.0.0.1:{free_ports(1)[0]}"


@pytest.fixture
async def client(address):
    client = RemoteDrafter("ngram", address, vocab_size=49152, timeout_s=2.0, metrics=TargetMetrics())
    yield client
    await client.close()


async def started_drafter(address: str, sequences: SequenceRegistry):
    drafter = create_drafter(address=address, metrics_address=None, sequences=sequences)
    await drafter.start()
    return drafter


async def eventually(condition, timeout_s: float = 15.0) -> bool:
    for _ in range(int(timeout_s / 0.05)):
        if condition():
            return True
        await asyncio.sleep(0.05)
    return condition()


async def eventually_async(ask, timeout_s: float = 15.0):
    """The first truthy answer of `ask()`, asked every 50 ms (a channel reconnects after a back-off)."""
    for _ in range(int(timeout_s / 0.05)):
        if answer := await ask():
            return answer
        await asyncio.sleep(0.05)
    return await ask()


async def test_a_release_the_drafter_missed_is_retried_until_it_hears(client, address):
    held = SequenceRegistry()
    drafter = await started_drafter(address, held)
    seq = sequence("s")
    await client.propose([(seq, 4)])
    assert len(held) == 1
    await drafter.stop(grace=0)  # the drafter is unreachable when the sequence finishes
    client.release(seq)
    await asyncio.sleep(1.0)
    assert len(held) == 1
    drafter = await started_drafter(address, held)  # reachable again, its state as it was
    try:
        assert await eventually(lambda: len(held) == 0)
    finally:
        await drafter.stop(grace=0)


async def test_a_drafter_that_learns_from_outputs_is_sent_a_finished_sequences_tokens_past_its_last_ask(address):
    """Suffix decoding's global tree learns the whole output, not the part the drafter was asked about: the
    tokens committed since its last update go to it before the release; it learns them in the sequence's
    corpus scope, for the requests of that scope alone."""
    drafter = create_drafter("suffix", address=address, metrics_address=None)
    await drafter.start()
    client = RemoteDrafter("suffix", address, vocab_size=49152, timeout_s=2.0, metrics=TargetMetrics())
    suffix = SpeculativeConfig("suffix", 4, corpus_scope="alice")
    try:
        await client.start()
        assert client.schema.learns_outputs
        first = Sequence("first", [1, 2, 3], SamplingParams(), suffix, 16, frozenset())
        await client.propose([(first, 4)])  # the drafter holds the prompt, and no token of the output
        first.tokens.extend([40, 41, 42, 43, 44, 45, 46, 47])  # committed in steps that did not ask it
        client.release(first)
        later = Sequence("later", [9, 40, 41, 42], SamplingParams(), suffix, 16, frozenset())

        async def drafted() -> list[int]:
            draft = (await client.propose([(later, 4)])).get("later")
            return list(draft.token_ids) if draft is not None else []

        assert (await eventually_async(drafted))[:3] == [43, 44, 45]  # from the scope's tree
        stranger = Sequence("stranger", [9, 40, 41, 42], SamplingParams(), SpeculativeConfig("suffix", 4,
                            corpus_scope="bob"), 16, frozenset())
        assert not (await client.propose([(stranger, 4)]))["stranger"].token_ids
    finally:
        await client.close()
        await drafter.stop(grace=0)


async def test_a_step_the_drafter_fails_is_draft_free_and_the_next_ask_opens_a_new_stream(client, address):
    held = SequenceRegistry()
    drafter = await started_drafter(address, held)
    seq = sequence("s")
    assert "s" in await client.propose([(seq, 4)])
    await drafter.stop(grace=0)  # the open stream breaks
    assert await client.propose([(seq, 4)]) is None  # no answer
    drafter = await started_drafter(address, held)
    try:
        assert await eventually_async(lambda: client.propose([(seq, 4)]))
    finally:
        await drafter.stop(grace=0)


async def test_an_answer_later_than_the_timeout_is_no_answer_and_the_task_that_asked_goes_on(client, address):
    drafter = await started_drafter(address, SequenceRegistry())
    hasty = RemoteDrafter("ngram", address, vocab_size=49152, timeout_s=1e-6, metrics=TargetMetrics())
    try:
        assert await hasty.propose([(sequence("s"), 4)]) is None
        await asyncio.sleep(0.01)  # would raise, had the timeout left a cancellation behind in this task
        assert "s" in await client.propose([(sequence("s"), 4)])  # the drafter itself answers in time
    finally:
        await hasty.close()
        await drafter.stop(grace=0)


async def test_requests_stay_within_the_drafter_api_bounds(client, address):
    held = SequenceRegistry()
    drafter = await started_drafter(address, held)
    try:
        too_long = sequence("too-long", [1] * (MAX_DRAFTER_SEQUENCE_TOKENS + 1))
        halves = [sequence(f"half{i}", [1] * (MAX_PROPOSE_TOKENS // 2)) for i in range(2)]
        late = sequence("late")
        wanted = [(s, 4) for s in (too_long, *halves, late)]
        assert set(await client.propose(wanted)) == {"half0", "half1"}  # "late" would pass the request's bound
        assert set(await client.propose(wanted)) == {"half0", "half1", "late"}  # the halves are synced now
        assert len(held) == 3  # never the sequence longer than a drafter holds
    finally:
        await drafter.stop(grace=0)


async def test_a_drafter_down_when_the_target_starts_costs_speed_then_serves_once_it_answers(tiny_model_dir, address):
    target = TargetService(TargetOptions(
        model=str(tiny_model_dir), address="127.0.0.1:0", metrics_address=None, kv_cache_tokens=2048,
        drafters={"ngram": address}, drafter_startup_timeout_s=0.5,
        default_speculative=SpeculativeConfig("ngram", 8, {"prompt_lookup_min": 1})))
    await target.start()  # no drafter listens yet: the target serves anyway
    drafter = None
    try:
        async with grpc.aio.insecure_channel(target.grpc_address) as channel:
            stub = target_pb2_grpc.TargetStub(channel)

            async def generate(method, **options):
                request = target_pb2.TargetGenerateRequest(
                    prompt_token_ids=LOOPING_PROMPT, sampling=common_pb2.SamplingParams(max_tokens=48),
                    speculative=common_pb2.SpeculativeConfig(method=method, options=options_to_pb(options)))
                chunks = [c async for c in stub.Generate(request)]
                return [t for c in chunks for t in c.token_ids], chunks[-1].usage

            plain, _ = await generate("none")
            tokens, usage = await generate("ngram")
            assert tokens == plain and usage.draft_tokens == 0  # draft-free while the drafter is down
            drafter = await started_drafter(address, SequenceRegistry())
            for _ in range(100):
                info = await stub.GetModelInfo(target_pb2.ModelInfoRequest())
                if not info.method_info[1].options_unknown:
                    break
                await asyncio.sleep(0.1)
            assert [o.name for o in info.method_info[1].options] == ["prompt_lookup_min", "prompt_lookup_max"]
            with pytest.raises(grpc.aio.AioRpcError) as error:  # its options are checked again
                await generate("ngram", prompt_lookup_min=0)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # Probed about every deadline / PROBE_SHARE seconds while it was down (a few seconds on a loaded
            # machine): asks resume once a probe is answered.
            for _ in range(200):
                tokens, usage = await generate("ngram")
                assert tokens == plain
                if usage.draft_tokens > 0:
                    break
            assert usage.draft_tokens > 0
    finally:
        await target.stop(0)
        if drafter is not None:
            await drafter.stop(0)
