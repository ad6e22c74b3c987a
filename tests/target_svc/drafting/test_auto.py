"""`method: auto` chooses, per sequence, the drafter whose drafts have gained it the most."""
import asyncio
import urllib.request

import grpc
import pytest

from drafter_svc.server import create_service as create_drafter
from specd.types import SpeculativeConfig
from specd.v1 import common_pb2, target_pb2, target_pb2_grpc
from specd.drafts import DraftTree
from target_svc.drafting.auto import (RECORD_ASKS_A_STEP, SHADOW_EVERY, SWITCH_MARGIN, TRIALS, MethodChooser,
                                      MethodRecord, ShadowDraft)
from target_svc.drafting.drafters import Drafters
from target_svc.drafting.lookahead import LookaheadSource
from target_svc.server import TargetOptions, TargetService
from tests.target_svc.drafting.test_fused import Constant, OneAskAtATime
from tests.target_svc.drafting.test_lookahead import cost_model
from tests.target_svc.test_scheduler import Oracle, bf16_scheduler, run_to_end, sequence


def ask(chooser: MethodChooser, gains: dict[str, float]) -> tuple[str, str]:
    """One step of the deployment, in which the chooser's sequence asks and its choice gains `gains`."""
    chooser.record.new_step()
    method, why = chooser.choose()
    chooser.observe(method, gains[method])
    return method, why


def test_every_drafter_is_tried_in_turn_before_any_is_preferred_while_the_deployment_has_no_record_of_it():
    chooser = MethodChooser(["ngram", "suffix", "trie"])
    first = [ask(chooser, {"ngram": 0.0, "suffix": 3.0, "trie": 1.0}) for _ in range(3 * TRIALS)]
    assert [m for m, _ in first] == ["ngram", "suffix", "trie"] * TRIALS
    assert {why for _, why in first} == {"trial"}


def past_the_trials(gains: dict[str, float]) -> MethodChooser:
    """A chooser among `gains`' drafters that has tried each of them TRIALS times."""
    chooser = MethodChooser(list(gains))
    for _ in range(len(gains) * TRIALS):
        ask(chooser, gains)
    return chooser


def test_after_the_trials_the_drafter_that_gained_most_is_asked():
    assert past_the_trials({"ngram": 0.5, "suffix": 2.0}).choose() == ("suffix", "best")


def test_a_drafter_that_gains_a_little_more_but_keeps_the_batch_waiting_longer_is_not_preferred():
    gains = {"suffix": 0.40, "draft_model": 0.45}
    assert past_the_trials(gains).choose() == ("draft_model", "best")
    # a draft model's round trip: 2.5 ms against suffix's 1 ms, on a 12 ms step
    assert past_the_trials(gains).choose({"suffix": 1.0 / 12, "draft_model": 2.5 / 12}) == ("suffix", "best")


def test_where_drafting_speeds_decoding_up_the_time_a_dearer_draft_costs_is_priced_at_that_speed():
    """Net of their price in plain decoding's tokens, `fused` gains 0.95 an ask and `suffix` 0.85; but
    `fused`'s larger drafts cost 0.35 tokens' time to verify, `suffix`'s 0.1. Where the deployment makes
    twice plain decoding's tokens a second, that time is worth twice as many."""
    record = MethodRecord()
    for _ in range(TRIALS):
        record.observe("fused", 0.95, price=0.35)
        record.observe("suffix", 0.85, price=0.1)
    assert MethodChooser(["fused", "suffix"], record).choose(speedup=1.0) == ("fused", "best")
    # past plain decoding's price: fused 0.95 - 0.35 = 0.6, suffix 0.85 - 0.1 = 0.75
    assert MethodChooser(["fused", "suffix"], record).choose(speedup=2.0) == ("suffix", "best")
    # So is the round trip: here their drafts cost the same, and fused's round trip 0.05 tokens more
    record.price["suffix"], record.gain["suffix"] = record.price["fused"], 0.88
    round_trip_cost = {"fused": 0.1, "suffix": 0.05}
    assert MethodChooser(["fused", "suffix"], record).choose(round_trip_cost, speedup=1.0) == ("fused", "best")
    assert MethodChooser(["fused", "suffix"], record).choose(round_trip_cost, speedup=2.0) == ("suffix", "best")


def test_a_new_sequence_starts_from_what_each_drafter_gained_the_deployments_earlier_ones_without_trials():
    record = MethodRecord()
    first = MethodChooser(["ngram", "suffix", "draft_model"], record)
    for _ in range(3 * TRIALS + 8):
        ask(first, {"ngram": 0.1, "suffix": 0.5, "draft_model": 1.5})
    later = MethodChooser(["ngram", "suffix", "draft_model"], record)
    assert later.choose() == ("draft_model", "best")
    # and its own asks take over from the record: where the draft model gains this one nothing, it moves on
    choices = [ask(later, {"ngram": 0.1, "suffix": 0.5, "draft_model": 0.0}) for _ in range(96)]
    assert choices[-8:] == [("suffix", "best")] * 8


def test_a_dry_spell_does_not_hand_the_sequence_to_a_drafter_that_offers_nothing():
    """Gains come in runs: a few rejected drafts in a row (their verification paid for) must not make
    a drafter that has paid the deployment look worse than one whose asks bring no draft at all."""
    record = MethodRecord()
    for _ in range(TRIALS):
        record.observe("suffix", 0.6)
        record.observe("lookahead", 0.0)  # its window does not pay at this load: asking it drafts nothing
    chooser = MethodChooser(["suffix", "lookahead"], record)
    dry_spell = 16  # asks in a row
    choices = [ask(chooser, {"suffix": -0.1, "lookahead": 0.0}) for _ in range(dry_spell)]
    assert {method for method, why in choices if why == "best"} == {"suffix"}


def test_a_sequence_stays_with_its_drafter_until_another_is_expected_to_gain_clearly_more():
    record = MethodRecord()
    for _ in range(TRIALS):
        record.observe("suffix", 1.0)
        record.observe("ngram", 1.0 + SWITCH_MARGIN / 2)
    chooser = MethodChooser(["suffix", "ngram"], record)
    assert chooser.choose() == ("ngram", "best")  # a first choice has nothing to stay with
    chooser.follow("suffix")  # the batch asked suffix for it: that is its drafter now
    assert chooser.choose() == ("suffix", "best")
    record.gain["ngram"] = 1.0 + 2 * SWITCH_MARGIN
    assert chooser.choose() == ("ngram", "best")


def test_a_dry_spell_between_shadow_steps_does_not_move_a_sequence_off_its_drafter():
    """The text dries up for every drafter alike; only at a shadow step are they seen side by side."""
    record = MethodRecord()
    for _ in range(64):
        record.observe("fused", 1.0)
        record.observe("suffix", 0.9)
    chooser = MethodChooser(["fused", "suffix"], record)
    while record.steps % SHADOW_EVERY != 0:
        record.new_step()
    for _ in range(SHADOW_EVERY - 1):  # a shadow step's worth of asks that gain nothing
        assert ask(chooser, {"fused": 0.0, "suffix": 0.0}) == ("fused", "best")
    assert chooser.choose() == ("fused", "best")


def test_a_sequence_leaves_a_drafter_not_worth_its_round_trip_for_one_that_is_however_close_their_worth():
    """The gate does not ask a drafter expected to gain less than its round trip costs: a sequence that
    stayed with it would go draft-free where another drafter pays."""
    record = MethodRecord()
    for _ in range(TRIALS):
        record.observe("suffix", 0.1)
        record.observe("ngram", 0.1 + SWITCH_MARGIN / 2)
    chooser = MethodChooser(["suffix", "ngram"], record)
    assert chooser.choose() == ("ngram", "best")
    round_trip_cost = {"ngram": 0.1 + SWITCH_MARGIN / 2 + 0.01, "suffix": 0.05}  # ngram no longer pays
    assert chooser.choose(round_trip_cost) == ("suffix", "best")
    assert chooser.choose({"ngram": 1.0, "suffix": 1.0}) == ("suffix", "best")  # none pays: it stays


def test_a_record_lifted_by_a_lucky_ask_does_not_keep_a_sequence_asking_a_drafter_that_gains_it_nothing():
    """The record of a drafter rarely asked is a mean of few asks. Where it counted as 2 of at most 7 asks,
    a record that had come out high kept sequences on a drafter their own asks showed gained them nothing
    (measured: in one of two runs of the same 26 Spec-Bench prompts on a fresh stack, `lookahead` took most
    "best" asks of 20 of them). A sequence's own asks must outweigh it."""
    record = MethodRecord()
    for _ in range(TRIALS):
        record.observe("suffix", 0.3)
        record.observe("lookahead", 1.0)
    chooser = MethodChooser(["suffix", "lookahead"], record)
    round_trip_cost = {"suffix": 0.07}  # lookahead's window rides in the forward: no round trip
    choices = []
    for _ in range(128):
        record.new_step()
        method, why = chooser.choose(round_trip_cost)
        chooser.observe(method, {"suffix": 0.3, "lookahead": 0.0}[method])
        choices.append((method, why))
    assert choices[-32:] == [("suffix", "best")] * 32


def test_the_record_is_the_plain_mean_of_a_drafters_first_asks_not_its_first_ask():
    record = MethodRecord()
    for gain in (0.0, 3.0, 3.0):  # tried first where there was nothing to draft from
        record.observe("trie", gain)
    assert record.gain["trie"] == pytest.approx(2.0)


def test_one_step_of_a_large_batch_moves_the_record_as_far_as_RECORD_ASKS_A_STEP_asks_not_as_all_of_them():
    """A shadow step's sequences are scored at the same point of their texts; at 50 of them, counting every
    one made that single moment most of the record."""
    def settled_record() -> MethodRecord:
        record = MethodRecord()
        for _ in range(200):
            record.new_step()
            record.observe("suffix", 1.0)
        record.new_step()
        return record

    one_step, few_asks, many_steps = settled_record(), settled_record(), settled_record()
    for _ in range(64):
        one_step.observe("suffix", 0.0)
    for _ in range(RECORD_ASKS_A_STEP):
        few_asks.observe("suffix", 0.0)
    for _ in range(64):
        many_steps.new_step()
        many_steps.observe("suffix", 0.0)
    assert many_steps.gain["suffix"] < one_step.gain["suffix"] == few_asks.gain["suffix"] < 1.0


def test_the_record_a_new_sequence_starts_from_counts_the_asks_made_at_set_times_not_those_made_for_gains():
    """A drafter asked because it was paying one sequence would look better to the next than it is."""
    record = MethodRecord()
    first = MethodChooser(["ngram", "suffix"], record)
    for _ in range(2 * TRIALS):
        ask(first, {"ngram": 0.5, "suffix": 0.4})
    shadow_steps = 0
    for _ in range(128):
        assert ask(first, {"ngram": 3.0, "suffix": 0.4}) == ("ngram", "best")  # a run n-gram finds
        shadow_steps += bool(first.shadows)
    # its trials, and its asks at shadow steps (their times set by the count of asks), not the others
    assert shadow_steps == 128 // SHADOW_EVERY and record.asks["ngram"] == TRIALS + shadow_steps


def test_every_few_asks_the_other_drafters_are_asked_beside_the_choice():
    record = MethodRecord()
    for _ in range(TRIALS):
        for method in ("ngram", "suffix", "lookahead"):
            record.observe(method, {"ngram": 1.0, "suffix": 0.5, "lookahead": 0.0}[method])
    chooser = MethodChooser(["ngram", "suffix", "lookahead"], record)
    choices, shadows = [], []
    for _ in range(2 * SHADOW_EVERY):
        choices.append(ask(chooser, {"ngram": 1.0, "suffix": 0.5, "lookahead": 0.0}))
        shadows.append(list(chooser.shadows))
    assert choices == [("ngram", "best")] * 2 * SHADOW_EVERY  # no verified ask of a drafter gaining less
    assert shadows == ([[]] * (SHADOW_EVERY - 1) + [["suffix", "lookahead"]]) * 2


def test_the_sequences_of_a_batch_ask_the_other_drafters_in_the_same_steps():
    """A step that asks every drafter waits for the slowest: one such step in SHADOW_EVERY, not one for
    each sequence whose own count of asks came round."""
    record = MethodRecord()
    for _ in range(TRIALS):
        record.observe("ngram", 1.0)
        record.observe("suffix", 0.5)
    choosers = {"early": MethodChooser(["ngram", "suffix"], record)}
    shadow_steps = {"early": [], "late": []}
    for step in range(1, 3 * SHADOW_EVERY + 1):
        record.new_step()
        if step == 4:  # a sequence joins the batch
            choosers["late"] = MethodChooser(["ngram", "suffix"], record)
        for name, chooser in choosers.items():
            if chooser.choose() == ("ngram", "best") and chooser.shadows:
                shadow_steps[name].append(step)
    assert shadow_steps == {"early": [8, 16, 24], "late": [8, 16, 24]}


def test_an_ask_the_gate_makes_after_passing_the_sequence_over_asks_the_other_drafters_beside_the_choice():
    """The gate goes by the chooser's estimate, which moves only where the drafters are compared."""
    record = MethodRecord()
    for _ in range(TRIALS):
        record.observe("ngram", 1.0)
        record.observe("suffix", 0.5)
    chooser = MethodChooser(["ngram", "suffix"], record)
    record.new_step()
    assert chooser.choose() == ("ngram", "best") and chooser.shadows == []  # not a shadow step
    chooser.compare()
    assert chooser.shadows == ["suffix"]


def test_a_drafter_on_trial_is_not_compared_with_the_others():
    chooser = MethodChooser(["ngram", "suffix"])
    assert chooser.choose() == ("ngram", "trial")
    chooser.compare()
    assert chooser.shadows == []


def test_a_sequence_held_by_the_record_on_one_drafter_moves_to_the_one_its_shadow_asks_show_gains_more():
    """The record said n-gram (its trials were lucky); at every shadow step suffix's draft, not verified,
    would have been accepted further: the sequence's choice and the record follow the shadows."""
    record = MethodRecord()
    for _ in range(TRIALS):
        record.observe("ngram", 1.0)
        record.observe("suffix", 0.0)
    chooser = MethodChooser(["ngram", "suffix"], record)
    tokens = list(range(100))
    for _ in range(6 * SHADOW_EVERY):
        record.new_step()
        method, _ = chooser.choose()
        for shadow in chooser.shadows:  # suffix drafts the next four tokens right, at a price of half a token
            chooser.shadowed(ShadowDraft(shadow, len(tokens), DraftTree.chain(list(range(len(tokens),
                                                                                         len(tokens) + 4))), 0.5))
        chooser.observe(method, {"ngram": 0.2, "suffix": 3.5}[method])
        tokens += range(len(tokens), len(tokens) + 5)
        chooser.settle(tokens, finished=False)
    assert chooser.choose()[0] == "suffix"
    assert record.gain["suffix"] > record.gain["ngram"]


def test_a_shadow_draft_is_scored_once_the_tokens_reach_past_it_as_far_as_they_match_less_its_price():
    shadow = ShadowDraft("suffix", 3, DraftTree((7, 8, 9), (-1, 0, 1), (0.9, 0.9, 0.9)), price=0.5)
    assert shadow.gain([1, 2, 3, 7, 8], finished=False) is None  # its third token's place is not known yet
    assert shadow.gain([1, 2, 3, 7, 8, 4], finished=False) == pytest.approx(1.5)
    assert shadow.gain([1, 2, 3, 7], finished=True) == pytest.approx(0.5)  # the sequence ended there


async def test_a_shadow_ask_joins_the_ask_its_drafter_gets_anyway_and_its_draft_comes_back_apart():
    ngram, suffix = OneAskAtATime("ngram", 5), OneAskAtATime("suffix", 6)
    drafters = Drafters([ngram, suffix, LookaheadSource()], vocab_size=64)
    await drafters.start()
    seq = sequence("a")
    seq.speculative = SpeculativeConfig(method="ngram")
    fused = sequence("b")
    fused.speculative = SpeculativeConfig(method="fused")  # its ask goes to every drafter: suffix's is shared
    answers = await drafters.propose([(seq, 2), (fused, 2)], shadows=[(seq, 2, "suffix")])
    assert ngram.asks == suffix.asks == 1
    assert answers.drafts["a"] == DraftTree.chain([5], [0.5])  # only the chosen drafter's is verified
    assert answers.shadows == {("a", "suffix"): DraftTree.chain([6], [0.5])}


async def test_lookahead_is_shadowed_by_the_draft_of_its_n_gram_pool_made_in_the_target():
    drafters = Drafters([OneAskAtATime("suffix", 6), LookaheadSource()], vocab_size=64)
    await drafters.start()
    seq = sequence("a")  # its prompt 5 6 7 8 9 5 6 7: the pool holds 7 -> 8 9 5
    seq.speculative = SpeculativeConfig(method="suffix")
    answers = await drafters.propose([(seq, 2)], shadows=[(seq, 2, "lookahead")])
    assert answers.shadows[("a", "lookahead")].token_ids == (8, 9)
    assert answers.drafts["a"] == DraftTree.chain([6], [0.5])


class ShadowsKept(MethodChooser):
    """An `auto` sequence's chooser that keeps every shadow draft it is handed."""

    def __init__(self, methods: list[str], record: MethodRecord):
        super().__init__(methods, record)
        self.handed: list[ShadowDraft] = []

    def shadowed(self, shadow: ShadowDraft) -> None:
        self.handed.append(shadow)
        super().shadowed(shadow)


class WindowWithoutPool(LookaheadSource):
    """Lookahead whose pool never drafts: all an ask of it brings a step is its window."""

    async def propose(self, wanted):
        await super().propose(wanted)
        return {}


async def test_a_lookahead_shadow_is_charged_the_window_an_ask_of_lookahead_would_run(tiny_model_dir):
    """Scored on its pool's draft alone, lookahead looked as good as an n-gram drafter, and each ask it then
    won paid for a window of ~15 tokens besides."""
    async with bf16_scheduler(tiny_model_dir) as scheduler:
        expected = await run_to_end(scheduler, sequence("a", max_tokens=48))
    async with bf16_scheduler(tiny_model_dir, sources=[Oracle({"a": expected}), WindowWithoutPool()],
                              cost_model=cost_model(1e-5)) as scheduler:
        seq = sequence("a", max_tokens=48)
        seq.speculative = SpeculativeConfig(method="auto", num_speculative_tokens=4)
        seq.chooser = ShadowsKept(scheduler._drafters.auto_methods, scheduler._drafters._auto_record)
        assert await run_to_end(scheduler, seq) == expected
    shadows = [shadow for shadow in seq.chooser.handed if shadow.method == "lookahead"]
    assert shadows and all(not shadow.draft and shadow.price > 0 for shadow in shadows)


class ShadowStepsKept(MethodChooser):
    """An `auto` sequence's chooser that keeps the deployment's step at which each shadow draft is handed."""

    def __init__(self, methods: list[str], record: MethodRecord):
        super().__init__(methods, record)
        self.shadow_steps: list[int] = []

    def shadowed(self, shadow: ShadowDraft) -> None:
        self.shadow_steps.append(self.record.steps)
        super().shadowed(shadow)


async def test_a_sequence_the_gate_passes_over_is_compared_at_every_probe_not_only_at_shadow_steps(tiny_model_dir):
    """Neither drafter's drafts are ever accepted: once the gate has seen enough, it asks only as a probe
    (spaced by the round trip: these drafters answer at once), and each probe is a step at which the
    estimates it goes by can move."""
    async with bf16_scheduler(tiny_model_dir, sources=[Constant("ngram", 5, 0.5), Constant("suffix", 6, 0.5)],
                              cost_model=cost_model(1e-5)) as scheduler:
        seq = sequence("a", max_tokens=96)
        seq.speculative = SpeculativeConfig(method="auto", num_speculative_tokens=4)
        seq.chooser = ShadowStepsKept(scheduler._drafters.auto_methods, scheduler._drafters._auto_record)
        await run_to_end(scheduler, seq)
    assert any(step % SHADOW_EVERY for step in seq.chooser.shadow_steps)


def test_auto_sequences_whose_best_choices_differ_all_ask_the_drafter_most_of_them_chose():
    """Each drafter a step asks costs the batch its round trip and its work on the target's cores."""
    drafters = Drafters([OneAskAtATime("ngram", 5), OneAskAtATime("suffix", 6)], vocab_size=64)
    batch = [sequence(name) for name in "abc"]
    for seq in batch:
        seq.speculative = SpeculativeConfig(method="auto")
    gains = {"a": {"ngram": 0.2, "suffix": 1.0}, "b": {"ngram": 0.2, "suffix": 1.0}, "c": {"ngram": 2.0, "suffix": 0.0}}

    def step(seqs):
        drafters.new_step()
        choices = drafters.choose_methods(seqs, {})
        for seq, (method, _) in zip(seqs, choices):
            seq.chooser.observe(method, gains[seq.request_id][method])
        return choices

    assert step(batch) == [("ngram", "trial")] * 3 and step(batch) == [("suffix", "trial")] * 3
    assert step(batch) == [("suffix", "best"), ("suffix", "best"), ("suffix", "batch")]
    assert batch[2].drafting_method == "suffix"
    assert step(batch[2:]) == [("ngram", "best")]  # alone, it asks its own choice


def test_fused_is_one_of_the_drafters_auto_chooses_among():
    drafters = Drafters([OneAskAtATime("ngram", 5), OneAskAtATime("suffix", 6)], vocab_size=64)
    asyncio.run(drafters.start())
    assert drafters.auto_methods == ["ngram", "suffix", "fused"]


async def test_a_shadow_of_fused_is_its_members_drafts_merged_from_the_asks_they_get_anyway():
    ngram, suffix = OneAskAtATime("ngram", 5), OneAskAtATime("suffix", 6)
    drafters = Drafters([ngram, suffix], vocab_size=64)
    await drafters.start()
    seq = sequence("a")
    seq.speculative = SpeculativeConfig(method="suffix")
    answers = await drafters.propose([(seq, 2)], shadows=[(seq, 2, "ngram"), (seq, 2, "fused")])
    assert ngram.asks == suffix.asks == 1
    assert answers.drafts["a"] == DraftTree.chain([6], [0.5])
    assert sorted(answers.shadows["a", "fused"].token_ids) == [5, 6]  # two branches: one from each member


def test_one_drafter_is_always_the_one_asked():
    chooser = MethodChooser(["ngram"])
    assert {ask(chooser, {"ngram": 0.0})[0] for _ in range(20)} == {"ngram"}


# -- through a real target with real n-gram and suffix drafter services, on the tiny model -----------------

REPETITIVE_PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
METHODS = ("ngram", "suffix")


@pytest.fixture
async def drafters():
    services = {m: create_drafter(m, address="127.0.0.1:0", metrics_address="127.0.0.1:0") for m in METHODS}
    for service in services.values():
        await service.start()
    yield services
    for service in services.values():
        await service.stop(0)


@pytest.fixture
async def target(tiny_model_dir, drafters):
    service = TargetService(TargetOptions(
        model=str(tiny_model_dir), address="127.0.0.1:0", metrics_address=None,
        drafters={m: s.grpc_address for m, s in drafters.items()}, kv_cache_tokens=2048, default_max_tokens=32,
        default_speculative=SpeculativeConfig(options={"prompt_lookup_min": 1})))  # no method: auto's
    await service.start()
    yield service
    await service.stop(0)


async def _generate(target, method: str) -> tuple[list[int], common_pb2.Usage]:
    async with grpc.aio.insecure_channel(target.grpc_address) as channel:
        request = target_pb2.TargetGenerateRequest(prompt_token_ids=REPETITIVE_PROMPT,
                                                   sampling=common_pb2.SamplingParams(max_tokens=32),
                                                   speculative=common_pb2.SpeculativeConfig(method=method))
        chunks = [c async for c in target_pb2_grpc.TargetStub(channel).Generate(request)]
    return [t for c in chunks for t in c.token_ids], chunks[-1].usage


async def test_auto_is_served_beside_the_drafters_and_its_greedy_output_is_nones(target):
    async with grpc.aio.insecure_channel(target.grpc_address) as channel:
        info = await target_pb2_grpc.TargetStub(channel).GetModelInfo(target_pb2.ModelInfoRequest())
    assert "auto" in info.methods
    plain, _ = await _generate(target, "none")
    auto, usage = await _generate(target, "auto")
    assert auto == plain and usage.draft_tokens > 0


async def test_a_request_naming_no_method_gets_auto_on_a_deployment_not_told_one(target):
    _, usage = await _generate(target, "")
    assert usage.draft_tokens > 0
    assert target.metrics.registry.get_sample_value("specd_auto_method_choices_total",
                                                    {"method": "ngram", "reason": "trial"}) == TRIALS


async def test_auto_tries_every_drafter_and_each_forgets_the_sequence_when_it_ends(target, drafters):
    await _generate(target, "auto")
    registry = target.metrics.registry
    for method in METHODS:
        assert registry.get_sample_value("specd_auto_method_choices_total",
                                         {"method": method, "reason": "trial"}) == TRIALS

    def held() -> list[float]:  # each drafter's own /metrics
        return [_gauge(urllib.request.urlopen(f"http://127.0.0.1:{s.metrics_port}/metrics").read().decode(),
                       "specd_drafter_sequences") for s in drafters.values()]

    for _ in range(100):  # releases go out after the response
        if held() == [0, 0]:
            break
        await asyncio.sleep(0.05)
    assert held() == [0, 0]


def _gauge(exposition: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in exposition.splitlines() if line.startswith(name + " "))
