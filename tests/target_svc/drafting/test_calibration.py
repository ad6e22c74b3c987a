"""The target trusts a drafter's acceptance estimates as far as they have come true."""
import pytest

from specd.drafts import DraftTree
from target_svc.drafting.calibration import MAX_DEPTH, AcceptanceCalibration


def chain(*probs):
    return DraftTree.chain([7] * len(probs), list(probs))


def test_estimates_are_taken_as_they_are_until_there_is_evidence():
    calibration = AcceptanceCalibration()
    assert calibration.corrected("ngram", chain(0.8, 0.8)) == chain(0.8, 0.8)
    calibration.observe("ngram", chain(0.8, 0.8), accepted=0)  # 1.44 tokens expected, none accepted
    assert 0.8 < calibration.factors("ngram")[0] < 1.0  # a little evidence moves them a little


def test_a_method_whose_first_drafts_all_missed_is_scaled_down_not_silenced():
    calibration = AcceptanceCalibration()
    for _ in range(9):
        calibration.observe("trie", chain(1.0), accepted=0)
    assert 0.4 < calibration.factors("trie")[0] < 0.5


def test_a_drafter_whose_estimates_run_high_is_scaled_down_and_each_method_on_its_own():
    calibration = AcceptanceCalibration()
    for _ in range(50):  # each draft expected to yield 1.5 tokens, 0.75 accepted on average
        calibration.observe("ngram", chain(0.75, 1.0), accepted=0)
        calibration.observe("ngram", chain(0.75, 1.0), accepted=1)
        calibration.observe("ngram", chain(0.75, 1.0), accepted=0)
        calibration.observe("ngram", chain(0.75, 1.0), accepted=2)
        calibration.observe("suffix", chain(0.5), accepted=1)
    assert calibration.factors("ngram")[:2] == pytest.approx([2 / 3, 1 / 3], rel=0.1)  # 2 of 4 reach depth 1, 1 depth 2
    assert sum(calibration.corrected("ngram", chain(0.75, 1.0)).reaches()) == pytest.approx(0.75, rel=0.1)
    assert calibration.corrected("suffix", chain(0.5)).probs[0] > 0.8  # estimates that ran low: raised...
    assert calibration.corrected("suffix", chain(0.9)).probs == (1.0,)  # ...to at most 1


def test_a_tree_is_corrected_at_every_branch_from_the_root():
    calibration = AcceptanceCalibration()
    for _ in range(50):
        calibration.observe("suffix", chain(1.0), accepted=0)
        calibration.observe("suffix", chain(1.0), accepted=1)
    tree = DraftTree((1, 2, 3), (-1, -1, 0), (0.6, 0.4, 0.5))
    factor = calibration.factors("suffix")[0]  # about a half; depth 2 unseen, so its reaches scale alike
    assert calibration.corrected("suffix", tree).reaches() == pytest.approx([0.6 * factor, 0.4 * factor, 0.3 * factor])
    assert factor == pytest.approx(0.5, abs=0.05)


def test_each_depth_is_corrected_by_how_far_the_estimates_there_came_true():
    """A drafter sure of its deep tokens (a trie's long branches) that are rarely reached: its depth-1
    estimates stand and its deeper ones fall, so the target stops verifying the tail; and a drafter
    too modest about its deep tokens gets them raised."""
    calibration = AcceptanceCalibration()
    for _ in range(200):
        calibration.observe("trie", chain(0.5, 1.0, 1.0), accepted=0)
        calibration.observe("trie", chain(0.5, 1.0, 1.0), accepted=1)
        calibration.observe("ngram", chain(0.5, 0.5), accepted=0)
        calibration.observe("ngram", chain(0.5, 0.5), accepted=2)
    assert calibration.factors("trie")[:3] == pytest.approx([1.0, 0.0, 0.0], abs=0.1)  # (the prior's bit left)
    assert calibration.corrected("trie", chain(0.5, 1.0, 1.0)).reaches() == pytest.approx([0.5, 0.0, 0.0], abs=0.05)
    assert calibration.factors("ngram")[:2] == pytest.approx([1.0, 2.0], rel=0.1)
    assert calibration.corrected("ngram", chain(0.5, 0.5)).reaches() == pytest.approx([0.5, 0.5], abs=0.05)


def test_siblings_raised_past_certainty_together_are_scaled_to_one():
    calibration = AcceptanceCalibration()
    for _ in range(200):
        calibration.observe("lookahead", chain(0.25), accepted=1)  # four times as often as estimated
    tree = DraftTree((1, 2, 3), (-1, -1, 0), (0.5, 0.25, 0.5))
    assert calibration.corrected("lookahead", tree).probs == pytest.approx((2 / 3, 1 / 3, 0.5), rel=0.05)


def test_past_the_deepest_tallied_depth_a_drafters_own_estimates_stand():
    """Long chains (`num_speculative_tokens` goes to 64) that come true all the way: their first MAX_DEPTH tokens are
    raised to certainty, and the rest keep the drafter's own chance per token, not cut off."""
    calibration = AcceptanceCalibration()
    for _ in range(100):
        calibration.observe("ngram", chain(*[0.9] * 24), accepted=24)
    reaches = calibration.corrected("ngram", chain(*[0.9] * 24)).reaches()
    assert reaches[:MAX_DEPTH] == pytest.approx([1.0] * MAX_DEPTH, abs=0.05)
    assert reaches[MAX_DEPTH:] == pytest.approx([0.9 ** n for n in range(1, 24 - MAX_DEPTH + 1)], abs=0.05)


def test_nodes_tallied_under_keys_of_their_own_are_corrected_each_by_its_keys_record():
    """`fused` keeps a member's guesses another member shares apart from those it makes alone."""
    calibration = AcceptanceCalibration()
    tree = DraftTree((5, 7, 8), (-1, -1, 1), (0.5, 0.5, 1.0))  # 5, or 7 and then 8
    for _ in range(100):  # 5 accepted each time
        calibration.observe_nodes("m/shared", tree, nodes=[0], accepted_nodes=[0])
        calibration.observe_nodes("m/alone", tree, nodes=[1, 2], accepted_nodes=[])
    assert calibration.factors("m/shared")[0] > 1.5 and calibration.factors("m/alone")[0] < 0.2
    corrected = calibration.corrected_nodes(["m/shared", "m/alone", "m/alone"], tree)
    assert corrected.probs[0] > 0.85 and corrected.probs[1] < 0.1
    # the alone node's child: its reach scaled by its own record at depth 2 (no evidence: drawn to depth 1's)
    assert corrected.reaches()[2] == pytest.approx(0.5 * calibration.factors("m/alone")[1], rel=1e-6)
