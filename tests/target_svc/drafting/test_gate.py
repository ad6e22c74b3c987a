"""A step asks the drafters only when the drafts the batch has been getting accepted are worth the
round trip; a sequence left unasked is asked again every few steps."""
from specd.types import SamplingParams, SpeculativeConfig
from target_svc.drafting.gate import PROBE_EVERY, DraftingGate
from target_svc.sequence import Sequence


def sequence(name: str) -> Sequence:
    return Sequence(name, [1, 2, 3], SamplingParams(max_tokens=8), SpeculativeConfig(method="ngram"), 8,
                    eos_token_ids=frozenset())


def test_a_sequence_never_asked_is_asked():
    assert DraftingGate().worth_asking([sequence("a")], decodes=1, step_seconds=0.015)


def test_drafts_that_gain_nothing_stop_being_asked_for_until_a_probe_is_due():
    gate, seq = DraftingGate(), sequence("a")
    gate.asked(0.002, [(seq, 0)])
    for _ in range(PROBE_EVERY):
        assert not gate.worth_asking([seq], decodes=1, step_seconds=0.015)
        gate.skipped([seq])
    assert gate.worth_asking([seq], decodes=1, step_seconds=0.015)  # probe: its text may have changed


def test_drafts_gaining_more_than_the_round_trip_costs_are_asked_for():
    gate, seqs = DraftingGate(), [sequence("a"), sequence("b")]
    gate.asked(0.002, [(seqs[0], 1), (seqs[1], 0)])
    # one token between two sequences each step, against 2 ms of a 15 ms step of two (0.27 tokens)
    assert gate.worth_asking(seqs, decodes=2, step_seconds=0.015)
    # a slow drafter: 20 ms of the same step costs 2.7 tokens
    gate.round_trip = 0.020
    assert not gate.worth_asking(seqs, decodes=2, step_seconds=0.015)


def test_nothing_to_ask_for_is_not_asked():
    assert not DraftingGate().worth_asking([], decodes=4, step_seconds=0.015)


def test_a_step_without_a_draft_on_offer_leaves_what_the_drafts_gained_as_it_was():
    gate, seq = DraftingGate(), sequence("a")
    gate.asked(0.002, [(seq, None)])  # nothing matched yet: no evidence against drafting
    assert seq.draft_gain is None and gate.worth_asking([seq], decodes=1, step_seconds=0.015)
    gate.asked(0.002, [(seq, 3)])
    gate.asked(0.002, [(seq, None)])
    assert seq.draft_gain == 3
