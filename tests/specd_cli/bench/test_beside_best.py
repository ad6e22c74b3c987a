"""`auto` beside the fastest single method of each category, and how far that moves with the prompts."""
import pytest

from specd_cli.bench.beside_best import beside_best
from specd_cli.bench.stats import OVERALL
from tests.specd_cli.bench.test_stats import record

METHODS = ["none", "suffix", "fused", "auto"]


def timed(system, prompt_id, category, seconds, tokens=100, **extra):
    """A request of `tokens` tokens that took `seconds`."""
    return record(system, prompt_id, category, tokens=[1] * tokens, e2e_s=seconds, **extra)


def test_auto_is_compared_with_the_fastest_single_method_of_each_category_none_aside():
    seconds = {"writing": {"none": 0.5, "suffix": 1.0, "fused": 1.5, "auto": 1.25},
               "coding": {"none": 0.5, "suffix": 2.0, "fused": 1.0, "auto": 0.8}}
    records = [timed(system, f"{category}-{i}", category, s)
               for category, by_system in seconds.items() for system, s in by_system.items() for i in range(3)]
    rows = {row.category: row for row in beside_best(records, METHODS)}
    assert (rows["writing"].fastest, rows["writing"].ratio) == ("suffix", pytest.approx(0.8))
    assert (rows["coding"].fastest, rows["coding"].ratio) == ("fused", pytest.approx(1.25))
    # overall: suffix 600 tokens in 9 s, fused in 7.5 s, auto in 6.15 s
    assert (rows[OVERALL].fastest, rows[OVERALL].ratio) == ("fused", pytest.approx(7.5 / 6.15))
    assert list(rows) == ["writing", "coding", OVERALL]


def test_where_every_prompt_gives_the_same_ratio_the_interval_is_that_ratio():
    records = [timed(system, str(i), "qa", s * (1 + i)) for i in range(5)
               for system, s in {"suffix": 1.0, "fused": 1.1, "auto": 0.9}.items()]
    row = next(row for row in beside_best(records, METHODS) if row.category == "qa")
    assert row.interval == pytest.approx((1 / 0.9, 1 / 0.9))


def test_the_fastest_of_several_is_picked_afresh_in_each_resample_so_the_interval_leans_below_a_tie():
    """On each prompt `auto` takes the mean of two methods' times, and they take turns being the faster: on
    all the prompts the three are as fast, but in a resample one of the two is nearly always ahead."""
    records = []
    for i in range(8):
        fast, slow = ("suffix", "fused") if i % 2 else ("fused", "suffix")
        records += [timed(fast, str(i), "qa", 1.0), timed(slow, str(i), "qa", 1.1), timed("auto", str(i), "qa", 1.05)]
    row = next(row for row in beside_best(records, METHODS) if row.category == "qa")
    assert row.ratio == pytest.approx(1.0)
    low, high = row.interval
    assert low < 0.98 and high == pytest.approx(1.0)


def test_only_prompts_every_compared_method_answered_count():
    records = [timed(system, str(i), "qa", 1.0) for i in range(3) for system in ("suffix", "fused", "auto")]
    records += [timed("suffix", "3", "qa", 0.1), timed("fused", "3", "qa", 0.1),
                timed("auto", "3", "qa", 9.0, error="DEADLINE_EXCEEDED")]
    row = next(row for row in beside_best(records, METHODS) if row.category == "qa")
    assert row.ratio == pytest.approx(1.0)


def test_without_auto_or_a_method_beside_it_there_is_nothing_to_compare():
    records = [timed(system, "1", "qa", 1.0) for system in METHODS]
    assert beside_best(records, ["none", "suffix", "fused"]) == []
    assert beside_best(records, ["none", "auto"]) == []
