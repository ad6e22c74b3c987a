"""What a drafter's work beside the forward costs: how much further the steps that ask it run over the
cost model's prediction than the steps that ask none."""
import pytest

from target_svc.drafting.overhang import AskOverhang


def test_nothing_is_added_before_steps_of_both_kinds_were_seen():
    overhang = AskOverhang()
    assert overhang.seconds("suffix") == 0.0
    for _ in range(10):  # at batch 1 every step asks: no step to compare with
        overhang.observe(["suffix"], 0.004)
    assert overhang.seconds("suffix") == 0.0


def test_a_drafter_whose_asks_slow_the_forward_costs_the_difference():
    overhang = AskOverhang()
    for _ in range(20):
        overhang.observe([], -0.002)
        overhang.observe(["suffix", "trie"], 0.004)
        overhang.observe(["lookahead"], -0.002)  # in the target: nothing runs beside its forward
    assert overhang.seconds("suffix") == pytest.approx(0.006)
    assert overhang.seconds("trie") == pytest.approx(0.006)
    assert overhang.seconds("lookahead") == pytest.approx(0.0)
    assert overhang.seconds("ngram") == 0.0  # never asked


def test_an_ask_never_counts_as_making_the_forward_faster():
    overhang = AskOverhang()
    overhang.observe([], 0.003)
    overhang.observe(["ngram"], -0.001)
    assert overhang.seconds("ngram") == 0.0


def test_the_excess_follows_recent_steps():
    overhang = AskOverhang()
    for _ in range(40):
        overhang.observe([], 0.0)
        overhang.observe(["suffix"], 0.010)
    for _ in range(200):  # the drafter's prompts indexed: its asks no longer slow anything
        overhang.observe([], 0.0)
        overhang.observe(["suffix"], 0.0)
    assert overhang.seconds("suffix") < 0.001
