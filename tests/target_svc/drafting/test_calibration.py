"""The target trusts a drafter's acceptance estimates as far as they have come true."""
import pytest

from target_svc.drafting.calibration import EVIDENCE_TOKENS, AcceptanceCalibration, expected_tokens


def test_a_draft_is_expected_to_yield_the_sum_of_its_reaches():
    assert expected_tokens([0.5, 0.5, 1.0]) == pytest.approx(0.5 + 0.25 + 0.25)
    assert expected_tokens([]) == 0


def test_estimates_are_taken_as_they_are_until_there_is_evidence():
    calibration = AcceptanceCalibration()
    assert calibration.corrected("ngram", [0.8, 0.8]) == [0.8, 0.8]
    calibration.observe("ngram", [0.8, 0.8], accepted=0)  # 1.44 tokens expected: too few to judge by
    assert EVIDENCE_TOKENS > 1.44 and calibration.factor("ngram") == 1.0


def test_a_drafter_whose_estimates_run_high_is_scaled_down_and_each_method_on_its_own():
    calibration = AcceptanceCalibration()
    for _ in range(50):  # each draft expected to yield 1.5 tokens, 0.75 accepted on average
        calibration.observe("ngram", [0.75, 1.0], accepted=0)
        calibration.observe("ngram", [0.75, 1.0], accepted=1)
        calibration.observe("ngram", [0.75, 1.0], accepted=0)
        calibration.observe("ngram", [0.75, 1.0], accepted=2)
        calibration.observe("suffix", [0.5], accepted=1)
    assert calibration.factor("ngram") == pytest.approx(0.5, rel=0.05)
    corrected = calibration.corrected("ngram", [0.75, 1.0])
    assert expected_tokens(corrected) == pytest.approx(0.75, rel=0.05)
    assert calibration.corrected("suffix", [0.5]) == [1.0]  # estimates that ran low: raised, at most 1
