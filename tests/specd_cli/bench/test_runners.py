"""The request timing and the two run loops, against a fake gRPC gateway that streams scripted
chunks and counts the requests in flight (the HTTP route is timed against the real gateway, in
tests/e2e/test_stack.py)."""
import asyncio
import math

import grpc
import pytest
from tqdm import tqdm

from specd.v1 import common_pb2, generation_pb2
from specd_cli.bench.errors import BenchError
from specd_cli.bench.gateway_requests import GrpcGateway
from specd_cli.bench.prompts import Prompt
from specd_cli.bench.records import RequestRecord
from specd_cli.bench.serve_runner import LoadRunner, ServeSettings, poisson_send_times
from specd_cli.bench.spec_runner import WARMUP_PROMPT, SpecRunner, SpecSettings, rotated


def chunks_of(token_groups, usage=None, finish_reason=common_pb2.FINISH_REASON_LENGTH):
    tokens = sum(len(g) for g in token_groups)
    usage = usage or common_pb2.Usage(prompt_tokens=7, completion_tokens=tokens,
                                        verification_steps=len(token_groups) - 1)
    out = [generation_pb2.GenerateResponse(text="x" * len(g), token_ids=g) for g in token_groups]
    out[-1].finish_reason = finish_reason
    out[-1].usage.CopyFrom(usage)
    return out


class FakeGateway(GrpcGateway):
    """The bench's gRPC route over a scripted client: this object is its own client."""

    def __init__(self, chunks=None, delay_s=0.0, fail_methods=()):
        super().__init__(self)
        self.chunks = chunks or chunks_of([[1], [2, 3]])
        self.delay_s = delay_s
        self.fail_methods = set(fail_methods)
        self.requests = []
        self.in_flight = self.most_in_flight = 0

    def generate(self, request, timeout=None):
        self.requests.append(request)
        return self._stream(request)

    async def _stream(self, request):
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if request.speculative.method in self.fail_methods:
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           details="target service unavailable")
            for chunk in self.chunks:
                await asyncio.sleep(self.delay_s)
                yield chunk
        finally:
            self.in_flight -= 1


PROMPTS = [Prompt(str(i), "writing" if i % 2 else "coding", f"question {i}") for i in range(4)]


async def test_a_timed_request_is_a_chat_request_for_the_method_with_the_given_sampling():
    gateway = FakeGateway()
    await gateway.timed_request(PROMPTS[0], "ngram", 0.7, 11, 64, timeout_s=5)
    (request,) = gateway.requests
    assert [(m.role, m.content) for m in request.chat.messages] == [("user", "question 0")]
    assert (request.speculative.method, request.sampling.max_tokens, request.sampling.seed) == ("ngram", 64, 11)
    assert request.sampling.temperature == pytest.approx(0.7)


async def test_a_timed_request_records_tokens_chunks_and_usage():
    usage = common_pb2.Usage(prompt_tokens=7, completion_tokens=3, verification_steps=2, draft_tokens=4,
                             accepted_draft_tokens=1)
    record = await FakeGateway(chunks_of([[1], [2, 3]], usage)).timed_request(PROMPTS[0], "ngram", 0.0, None, 8, 5)
    assert record.ok and record.token_ids == [1, 2, 3] and record.text == "xxx"
    assert [n for _, n in record.chunks] == [1, 2]
    assert record.chunks[0][0] <= record.chunks[1][0] <= record.e2e_s
    assert (record.prompt_tokens, record.verification_steps, record.draft_tokens, record.accepted_draft_tokens,
            record.finish_reason) == (7, 2, 4, 1, "length")


async def test_a_failed_rpc_is_recorded_not_raised():
    record = await FakeGateway(fail_methods={"ngram"}).timed_request(PROMPTS[0], "ngram", 0.0, None, 8, 5)
    assert record.error == "UNAVAILABLE: target service unavailable"


async def test_a_usage_that_disagrees_with_the_stream_is_an_error():
    usage = common_pb2.Usage(completion_tokens=5, verification_steps=2)
    record = await FakeGateway(chunks_of([[1], [2]], usage)).timed_request(PROMPTS[0], "none", 0.0, None, 8, 5)
    assert "usage reports 5 completion tokens, the stream carried 2" in record.error


def test_rotation_moves_each_system_to_the_front_in_turn():
    assert [rotated(["a", "b", "c"], i) for i in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                               ["a", "b", "c"]]


class FakeBaselines:
    def __init__(self):
        self.calls = []

    def run(self, baseline, prompt, temperature, seed, max_tokens):
        self.calls.append((baseline, prompt.prompt_id, temperature, seed, max_tokens))
        return RequestRecord(baseline, prompt.prompt_id, prompt.category, temperature, seed, max_tokens)


def spec_settings(**kw):
    values = dict(methods=["none", "ngram"], baselines=["hf"], temperatures=[0.0, 1.0], seed=100, max_tokens=16,
                  warmup=2, timeout_s=5.0)
    values.update(kw)
    return SpecSettings(**values)


async def test_spec_run_sends_every_prompt_to_every_system_back_to_back_in_rotated_order():
    gateway, baselines = FakeGateway(), FakeBaselines()
    records = await SpecRunner(gateway, spec_settings(), baselines).run(PROMPTS[:2])
    assert [(r.temperature, r.prompt_id, r.system) for r in records[:6]] == [
        (0.0, "0", "none"), (0.0, "0", "ngram"), (0.0, "0", "hf"),
        (0.0, "1", "ngram"), (0.0, "1", "hf"), (0.0, "1", "none")]
    assert len(records) == 2 * 2 * 3
    assert {r.max_tokens for r in records} == {16}


async def test_a_second_pass_runs_the_speculative_methods_again_under_their_own_label():
    settings = spec_settings(methods=["none", "ngram", "suffix"], temperatures=[0.0], passes=2)
    records = await SpecRunner(FakeGateway(), settings, FakeBaselines()).run(PROMPTS[:2])
    assert len(records) == 2 * 4 + 2 * 2
    assert {(r.prompt_id, r.system) for r in records[8:]} == {
        (p, f"{m} pass 2") for p in ("0", "1") for m in ("ngram", "suffix")}
    assert settings.reported_systems == ["none", "ngram", "suffix", "hf", "ngram pass 2", "suffix pass 2"]


async def test_sampled_requests_share_one_seed_per_prompt_and_greedy_ones_have_none():
    records = await SpecRunner(FakeGateway(), spec_settings(), FakeBaselines()).run(PROMPTS[:2])
    assert {r.seed for r in records if r.temperature == 0} == {None}
    seeds = {(r.prompt_id, r.seed) for r in records if r.temperature == 1.0}
    assert seeds == {("0", 100), ("1", 101)}


async def test_warm_up_uses_its_own_prompt_for_every_system_and_temperature():
    gateway, baselines = FakeGateway(), FakeBaselines()
    await SpecRunner(gateway, spec_settings(), baselines).warm_up()
    assert len(gateway.requests) == 2 * 2 * 2 and len(baselines.calls) == 2 * 2
    assert {m.content for r in gateway.requests for m in r.chat.messages} == {WARMUP_PROMPT.text}


async def test_a_failing_warm_up_stops_the_run_with_the_reason():
    with pytest.raises(BenchError, match="warm-up request of ngram failed: UNAVAILABLE"):
        await SpecRunner(FakeGateway(fail_methods={"ngram"}), spec_settings(), FakeBaselines()).warm_up()


def test_poisson_send_times_are_seeded_with_mean_spacing_one_over_the_rate():
    times = poisson_send_times(2000, rate=4.0, seed=1)
    assert times == poisson_send_times(2000, rate=4.0, seed=1)
    assert times[0] == 0.0 and times == sorted(times)
    assert times[-1] / 1999 == pytest.approx(0.25, rel=0.1)
    assert poisson_send_times(3, math.inf, seed=1) == [0.0, 0.0, 0.0]


def serve_settings(**kw):
    values = dict(methods=["none", "ngram"], concurrencies=[1, 3], request_rate=math.inf, num_prompts=[4, 4],
                  max_tokens=8, temperature=0.0, seed=0, warmup=1, timeout_s=5.0)
    values.update(kw)
    return ServeSettings(**values)


async def test_closed_loop_keeps_at_most_concurrency_requests_in_flight_and_sends_every_prompt():
    gateway = FakeGateway(delay_s=0.01)
    runner = LoadRunner(gateway, serve_settings(), [PROMPTS, PROMPTS])
    with tqdm(disable=True) as bar:
        records = await runner.run_level("ngram", 3, bar, PROMPTS)
    assert gateway.most_in_flight == 3
    assert sorted(r.prompt_id for r in records) == ["0", "1", "2", "3"]
    assert {r.concurrency for r in records} == {3}
    assert all(r.sent_at_s >= 0 for r in records)


async def test_poisson_arrivals_are_spread_over_time():
    runner = LoadRunner(FakeGateway(), serve_settings(request_rate=50.0), [PROMPTS, PROMPTS])
    with tqdm(disable=True) as bar:
        records = await runner.run_level("none", 4, bar, PROMPTS)
    sent = sorted(r.sent_at_s for r in records)
    assert sent[-1] - sent[0] == pytest.approx(poisson_send_times(4, 50.0, 0)[-1], abs=0.05)


async def test_methods_take_turns_over_slices_of_a_level_in_an_order_rotated_each_round():
    gateway = FakeGateway()
    prompts = [Prompt(str(i), "writing", f"question {i}") for i in range(8)]
    runner = LoadRunner(gateway, serve_settings(concurrencies=[1], rounds=4), [prompts])
    records = await runner.run()
    blocks = [(r.load_round, r.system) for r in records]
    assert list(dict.fromkeys(blocks)) == [(0, "none"), (0, "ngram"), (1, "ngram"), (1, "none"),
                                           (2, "none"), (2, "ngram"), (3, "ngram"), (3, "none")]
    for method in ("none", "ngram"):
        assert sorted(int(r.prompt_id) for r in records if r.system == method) == list(range(8))
    assert [(r.load_round, r.prompt_id) for r in records if r.system == "none"] == [
        (n // 2, str(n)) for n in range(8)]


def test_a_level_has_fewer_rounds_where_a_slice_would_not_reach_its_full_load():
    runner = LoadRunner(FakeGateway(), serve_settings(rounds=4), [])
    assert runner.slices(10, 1) == [range(0, 2), range(2, 5), range(5, 7), range(7, 10)]
    assert runner.slices(10, 2) == [range(0, 5), range(5, 10)]
    assert runner.slices(10, 8) == [range(0, 10)]


async def test_a_load_run_covers_every_method_and_concurrency_and_counts_failures():
    later = [Prompt(str(i), "coding", f"question {i}") for i in range(4, 8)]
    runner = LoadRunner(FakeGateway(fail_methods={"ngram"}), serve_settings(), [PROMPTS, later])
    records = await runner.run()
    assert len(records) == 2 * 2 * 4
    assert {(r.system, r.concurrency) for r in records} == {(m, c) for m in ("none", "ngram") for c in (1, 3)}
    # each level its own prompts, every method the same ones
    for concurrency, prompts in ((1, PROMPTS), (3, later)):
        for method in ("none", "ngram"):
            assert sorted(r.prompt_id for r in records if (r.system, r.concurrency) == (method, concurrency)) == [
                p.prompt_id for p in prompts]
    assert sum(not r.ok for r in records) == 8
