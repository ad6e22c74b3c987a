"""A step asks a drafter for the sequences whose drafts are expected to gain (accepted tokens, less what
verifying them cost) more than their part of the round trip costs, and only when together they are worth
its fixed part too; a batch left unasked is asked again every few steps."""
import pytest

from specd.types import SamplingParams, SpeculativeConfig
from target_svc.drafting.auto import TRIALS, MethodChooser, MethodRecord
from target_svc.drafting.gate import (MISSES_BEFORE_PROBING, PROBE_EVERY, PROBE_SHARE, TYPICAL_EVIDENCE, DraftingGate,
                                      RoundTripLine)
from target_svc.sequence import Sequence


def sequence(name: str) -> Sequence:
    return Sequence(name, [1, 2, 3], SamplingParams(max_tokens=8), SpeculativeConfig(method="ngram"), 8,
                    eos_token_ids=frozenset())


def seasoned() -> DraftingGate:
    """A gate that has seen enough asks to go by the typical gain."""
    gate = DraftingGate()
    gate.evidence = TYPICAL_EVIDENCE
    return gate


def test_a_sequence_never_asked_is_asked():
    assert DraftingGate().to_ask([sequence("a")], decodes=1, plain_seconds=0.015, step_seconds=0.015)


def test_until_asks_have_shown_what_they_gain_every_step_asks():
    gate, seq = DraftingGate(), sequence("a")
    for _ in range(TYPICAL_EVIDENCE):  # empty answers early on: the text has not repeated yet
        assert gate.to_ask([seq], decodes=1, plain_seconds=0.015, step_seconds=0.015)
        gate.asked(0.002, [(seq, 0.0)])
    assert not gate.to_ask([seq], decodes=1, plain_seconds=0.015, step_seconds=0.015)


def test_drafts_that_gain_nothing_stop_being_asked_for_until_a_probe_is_due():
    gate, seq = seasoned(), sequence("a")
    gate.asked(0.002, [(seq, 0)])
    for _ in range(PROBE_EVERY):
        assert not gate.to_ask([seq], decodes=1, plain_seconds=0.015, step_seconds=0.015)
        gate.skipped([seq])
    assert gate.to_ask([seq], decodes=1, plain_seconds=0.015, step_seconds=0.015)  # probe: the text may have changed


def test_a_drafter_whose_round_trip_is_long_next_to_a_step_is_probed_less_often():
    gate, seq = seasoned(), sequence("a")
    gate.asked(0.060, [(seq, 0)])  # four 15 ms steps: probes every 8 steps would cost a third of the time
    for _ in range(round(0.060 / (PROBE_SHARE * 0.015))):  # 200 steps: the probes cost PROBE_SHARE of the time
        assert not gate.to_ask([seq], decodes=1, plain_seconds=0.015, step_seconds=0.015)
        gate.skipped([seq])
    assert gate.to_ask([seq], decodes=1, plain_seconds=0.015, step_seconds=0.015)


def test_drafters_wanted_in_the_same_steps_share_the_probes_time():
    """Under `auto` a batch's sequences want several drafters: probed each on its own, five of them would
    ask in a third of the steps for drafts that do not pay."""
    gate, seq = seasoned(), sequence("a")
    gate.asked(0.006, [(seq, 0)])  # alone, 20 steps between probes; with four others, 100
    for _ in range(round(5 * 0.006 / (PROBE_SHARE * 0.015))):
        assert not gate.to_ask([seq], decodes=1, plain_seconds=0.015, step_seconds=0.015, drafters=5)
        gate.skipped([seq])
    assert gate.to_ask([seq], decodes=1, plain_seconds=0.015, step_seconds=0.015, drafters=5)


def test_probes_are_spaced_by_the_typical_round_trip_not_the_fastest():
    """A model drafter's probe catches its cache up on every token since the last: one fast answer does
    not make its probes cheap."""
    gate, seq = seasoned(), sequence("a")
    for round_trip in (0.004, 0.045, 0.045, 0.045, 0.045, 0.045, 0.045, 0.045):
        gate.asked(round_trip, [(seq, 0)])
    for _ in range(round(0.035 / (PROBE_SHARE * 0.015))):  # by the fastest it would be 13
        assert not gate.to_ask([seq], decodes=1, plain_seconds=0.015, step_seconds=0.015)
        gate.skipped([seq])


def test_one_unanswered_ask_is_a_busy_moment_the_next_step_asks_as_before():
    gate, seq = seasoned(), sequence("a")
    gate.asked(0.002, [(seq, 3.0)])
    gate.went_unanswered(0.050)  # the drafter was busy past its deadline
    assert gate.round_trip == 0.002  # the deadline is not what an answer takes
    assert gate.to_ask([seq], decodes=1, plain_seconds=0.015, step_seconds=0.015)


def test_a_drafter_that_missed_asks_in_a_row_is_asked_only_as_a_probe_spaced_by_what_they_took():
    """Even before asks have shown what they gain: a drafter that is down would otherwise cost every step
    its deadline."""
    gate, seq = DraftingGate(), sequence("a")
    for _ in range(MISSES_BEFORE_PROBING):
        gate.went_unanswered(0.050)
    for _ in range(round(0.050 / (PROBE_SHARE * 0.015))):
        assert not gate.to_ask([seq], decodes=1, plain_seconds=0.015, step_seconds=0.015)
        gate.skipped([seq])
    assert gate.to_ask([seq], decodes=1, plain_seconds=0.015, step_seconds=0.015)


def test_once_a_probe_is_answered_asks_go_by_the_answered_round_trip_again():
    """A drafter that was down when the target started answers a probe: asks resume at once where they gain,
    not probes spaced by the deadline-long failures."""
    gate, seq = seasoned(), sequence("a")
    gate.asked(0.001, [(seq, 3.0)])
    for _ in range(8):
        gate.went_unanswered(0.050)
    assert not gate.to_ask([seq], decodes=1, plain_seconds=0.015, step_seconds=0.015)
    gate.asked(0.001, [(seq, 3.0)])
    assert gate.round_trip == 0.001
    assert gate.to_ask([seq], decodes=1, plain_seconds=0.015, step_seconds=0.015)


def test_a_drafter_rides_along_in_a_step_that_waits_as_long_for_another():
    """Asked concurrently, a drafter no slower than the one the step waits for costs the step no wait."""
    gate, seq = seasoned(), sequence("a")
    gate.asked(0.002, [(seq, 0.0)])
    assert gate.riding([seq], 0.003) == [seq]
    assert gate.riding([seq], 0.001) == []  # the step would wait longer for it


def test_a_drafter_rides_along_for_as_many_sequences_as_keep_it_no_slower_those_expected_to_gain_most_first():
    gate, batch = seasoned(), [sequence(f"s{i}") for i in range(8)]
    for sequences in (8, 2, 4, 6) * 6:  # 1 ms a sequence, 1 ms besides
        gate.asked(0.001 + 0.001 * sequences, [(seq, float(i)) for i, seq in enumerate(batch[:sequences])])
    assert gate.riding(batch, 0.0045) == [batch[7], batch[6], batch[5]]


def test_a_drafter_never_answered_or_missing_asks_does_not_ride_along():
    seq = sequence("a")
    assert DraftingGate().riding([seq], 1.0) == []  # its round trip is unknown
    gate = seasoned()
    gate.asked(0.002, [(seq, 1.0)])
    for _ in range(MISSES_BEFORE_PROBING):
        gate.went_unanswered(0.050)
    assert gate.riding([seq], 1.0) == []  # down or overloaded: it could cost the deadline


def test_drafts_gaining_more_than_the_round_trip_costs_are_asked_for():
    gate, seqs = seasoned(), [sequence("a"), sequence("b")]
    gate.asked(0.002, [(seqs[0], 1), (seqs[1], 0)])
    # one token between two sequences each step, against 2 ms of a 15 ms step of two (0.27 tokens)
    assert gate.to_ask(seqs, decodes=2, plain_seconds=0.015, step_seconds=0.015)
    # a slow drafter: 20 ms of the same step costs 2.7 tokens
    slow = seasoned()
    slow.asked(0.020, [(seqs[0], 1), (seqs[1], 0)])
    assert not slow.to_ask(seqs, decodes=2, plain_seconds=0.015, step_seconds=0.015)
    # nor when the steps are ten times as long with prompt work: the round trip still holds up plain decoding
    assert not slow.to_ask(seqs, decodes=2, plain_seconds=0.015, step_seconds=0.150)


def test_a_round_trip_is_fitted_as_a_fixed_part_and_a_part_per_sequence_asked():
    line = RoundTripLine()
    for sequences in (8, 64, 16, 48, 32) * 6:
        line.observe(sequences, 0.002 + 0.00025 * sequences)
    assert line.fit() == pytest.approx((0.002, 0.00025))  # fixed, per sequence
    assert line.seconds(10) == pytest.approx(0.0045)


def test_until_the_counts_asked_vary_a_round_trip_is_shared_evenly_by_the_sequences_asked():
    line = RoundTripLine()
    for _ in range(5):
        line.observe(64, 0.016)
    assert line.fit() == pytest.approx((0.0, 0.00025))  # fixed, per sequence


def test_a_sequence_gaining_more_than_its_share_of_a_whole_batch_ask_is_asked_for_alone():
    """Asked for with the whole batch, one copying sequence cannot pay for everyone's round trip; asked for
    alone, it pays for its share, and the counts asked start to vary."""
    gate = seasoned()
    batch = [sequence(f"s{i}") for i in range(8)]
    gate.asked(0.008, [(seq, 3.0 if seq is batch[0] else 0.0) for seq in batch])
    assert sum(gate.expected_gain(seq) for seq in batch) < 0.008 * 8 / 0.021  # 3 tokens against 3.05
    assert gate.to_ask(batch, decodes=8, plain_seconds=0.021, step_seconds=0.021) == [batch[0]]


def test_under_load_the_sequences_whose_drafts_pay_are_asked_for_without_the_rest():
    """At 64 clients a few sequences copying a passage gain the batch tokens, the rest nothing: asked for
    alone, they pay for their part of the round trip; asked for with the whole batch (17 ms), they do not."""
    gate = seasoned()
    batch = [sequence(f"s{i}") for i in range(64)]
    for sequences in (64, 8, 32, 16) * 6:  # ~0.25 ms a sequence, 1 ms besides
        gate.asked(0.001 + 0.00025 * sequences, [(seq, 1.0 if i < 6 else 0.0) for i, seq in enumerate(batch[:sequences])])
    picked = gate.to_ask(batch, decodes=64, plain_seconds=0.160, step_seconds=0.160)
    assert picked == batch[:6]
    # the whole batch's expected gain (6 tokens) is worth less than its round trip (17 ms = 6.8 tokens)
    assert sum(gate.expected_gain(seq) for seq in batch) < gate.line.seconds(64) * 64 / 0.160


def test_sequences_left_out_of_an_ask_are_expected_to_gain_more_like_the_typical_each_step():
    gate, dull, lively = seasoned(), sequence("dull"), sequence("lively")
    gate.asked(0.002, [(dull, 0.0), (lively, 4.0)])
    before = gate.expected_gain(dull)
    gate.left_out([dull])
    assert gate.unasked_steps == 0  # the drafter was asked, for others
    assert before < gate.expected_gain(dull) < gate.typical_gain


def test_nothing_to_ask_for_is_not_asked():
    assert not DraftingGate().to_ask([], decodes=4, plain_seconds=0.015, step_seconds=0.015)


def test_an_ask_with_nothing_on_offer_gains_nothing():
    gate, seq = seasoned(), sequence("a")
    gate.asked(0.002, [(seq, 3.0)])
    for _ in range(80):  # the round trip was paid each time, for no draft
        gate.asked(0.002, [(seq, 0.0)])
    assert not gate.to_ask([seq], decodes=1, plain_seconds=0.015, step_seconds=0.015)


def test_a_run_of_accepted_drafts_keeps_the_asks_coming_through_the_dry_spell_after_it():
    gate, seq = seasoned(), sequence("a")
    gate.asked(0.002, [(seq, 3.0)])  # a passage copied
    for _ in range(12):  # then a dozen asks with nothing on offer: the next passage may come at any step
        gate.asked(0.002, [(seq, 0.0)])
        assert gate.to_ask([seq], decodes=1, plain_seconds=0.015, step_seconds=0.015)


def test_a_newcomer_is_expected_to_gain_what_asks_typically_gain():
    gate, old = seasoned(), [sequence(name) for name in "abc"]
    gate.asked(0.002, [(seq, gain) for seq, gain in zip(old, [0.0, 0.0, 1.5])])
    newcomer = sequence("new")
    assert gate.expected_gain(newcomer) == gate.typical_gain
    # asks have been paying for one sequence in three: one newcomer is not worth asking a batch of 16 for
    assert not gate.to_ask([newcomer], decodes=16, plain_seconds=0.050, step_seconds=0.050)


def test_a_sequence_left_unasked_is_expected_to_gain_more_like_the_typical_each_step():
    gate, dull, lively = seasoned(), sequence("dull"), sequence("lively")
    gate.asked(0.002, [(dull, 0.0), (lively, 4.0)])
    before = gate.expected_gain(dull)
    gate.skipped([dull])
    gate.skipped([dull])
    assert before < gate.expected_gain(dull) < gate.typical_gain


def test_drafts_that_cost_the_batch_what_they_gain_are_not_worth_a_round_trip():
    gate, seqs = seasoned(), [sequence(name) for name in "abcd"]
    # each draft had 2 tokens accepted, but verifying it cost the batch 1.9 tokens' time
    gate.asked(0.002, [(seq, 2 - 1.9) for seq in seqs])
    # 0.4 tokens gained, against 2 ms of a 15 ms step of four (0.53 tokens)
    assert not gate.to_ask(seqs, decodes=4, plain_seconds=0.015, step_seconds=0.015)


def test_a_newcomers_first_asks_count_in_full_so_its_first_run_of_accepted_drafts_keeps_it_asked():
    gate, seq = seasoned(), sequence("a")
    gate.typical_gain = 0.0  # asks have gained other sequences nothing lately
    gate.asked(0.002, [(seq, 0.0)])
    gate.asked(0.002, [(seq, 3.0)])  # a probe found a passage to copy
    assert seq.draft_gain == 1.5
    assert gate.to_ask([seq], decodes=1, plain_seconds=0.015, step_seconds=0.015)


def test_under_auto_a_drafter_is_judged_by_what_the_chooser_expects_of_it_not_by_the_sequences_other_asks():
    """The sequence's own mean gain mixes every drafter it asked: after a dry spell on one, the drafter the
    chooser moved it to for its shadow drafts went unasked for most of its turn (measured: 35-46 of ~150
    steps of a Spec-Bench prompt asked nothing that `suffix` alone asked at)."""
    record = MethodRecord()
    for _ in range(TRIALS):
        record.observe("suffix", 1.0)
        record.observe("ngram", 0.0)
    seq = sequence("a")
    seq.chooser = MethodChooser(["suffix", "ngram"], record)
    gate = seasoned()
    gate.asked(0.002, [(seq, 0.0)] * 20)  # its asks so far gained nothing (another drafter's)
    assert seq.chooser.choose() == ("suffix", "best")
    assert gate.to_ask([seq], decodes=1, plain_seconds=0.015, step_seconds=0.015)
