"""The target verifies the draft tokens that raise the batch's goodput, by its step cost model."""
import pytest

from specd.drafts import DraftTree
from target_svc.cost_model import Fit, StepCostModel, StepShape
from target_svc.drafting.length import DRAFT_MARGIN, choose_drafts


def linear_cost(fixed: float, per_token: float) -> Fit:
    """What a start-up profile that measured exactly fixed + per_token * tokens seconds prices drafts by."""
    model = StepCostModel()
    for tokens in (1, 8, 64, 512):
        for context in (0, 1000):
            model.observe(StepShape.of([(context, tokens)]), fixed + per_token * tokens, profile=True)
    return model.quiet


CHEAP = linear_cost(0.020, 0.0005)  # a draft token costs 2.5% of a one-token step


def lengths(candidates, cost=CHEAP, cached=None):
    """Kept tokens per candidate, each a chain given as its tokens' estimates (or a DraftTree)."""
    cached = cached or [0] * len(candidates)
    drafts = [c if isinstance(c, DraftTree) else DraftTree.chain([7] * len(c), c) for c in candidates]
    return choose_drafts(drafts, cached, cost).lengths


def test_alone_a_draft_is_verified_while_its_tokens_carry_more_than_they_cost():
    assert lengths([[0.9] * 8]) == [8]
    assert lengths([[0.01] * 8]) == [0]  # 0.01 of a token for 2.5% of a step: not worth it
    assert lengths([[0.9, 0.9, 0.01, 0.9]]) == [2]  # cut where the reach falls


def test_a_draft_token_must_pay_for_itself_with_a_margin_to_spare():
    # Alone, a draft token costs 0.5 ms on a 20.5 ms step: worth its price from 0.0244 of a token, but kept only
    # with DRAFT_MARGIN to spare, since the cost model does not price everything a draft costs.
    pays = 0.0005 / 0.0205
    assert lengths([[pays * (1 + DRAFT_MARGIN / 2)]]) == [0]
    assert lengths([[pays * (1 + DRAFT_MARGIN * 1.5)]]) == [1]


def test_under_load_the_same_drafts_are_cut_and_at_high_load_dropped():
    alone = lengths([[0.6] * 8])[0]
    crowded = lengths([[0.6] * 8] * 8)
    assert alone > crowded[0] > 0
    assert lengths([[0.6] * 8] * 64) == [0] * 64


def test_the_likelier_drafts_of_a_batch_are_kept_first():
    assert lengths([[0.95] * 4, [0.3] * 4] * 8) == [4, 0] * 8


@pytest.mark.parametrize("acceptance", [0.0, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("k", [0, 1, 3, 16])
def test_never_more_than_the_draft(acceptance, k):
    assert 0 <= lengths([[acceptance] * k])[0] <= k


def test_a_draft_token_of_a_long_sequence_costs_more_so_it_must_be_likelier():
    cost = StepCostModel()  # each query-key pair of attention costs as much as 1/2000 of a new token
    for cached in (0, 1000, 4000):
        for tokens in (1, 8, 64):
            shape = StepShape.of([(cached, tokens)])
            cost.observe(shape, 0.020 + 0.0005 * tokens + 0.00000025 * shape.pairs, profile=True)
    same_drafts = [[0.5] * 8, [0.5] * 8]
    short, long = lengths(same_drafts, cost.quiet, cached=[10, 8000])
    assert short > long


def test_the_choice_says_what_it_expects():
    choice = choose_drafts([DraftTree.chain([3, 4]), DraftTree()], [0, 0], CHEAP)
    assert choice.lengths == [2, 0]
    assert choice.expected_tokens == pytest.approx(4.0)
    assert choice.plain_seconds == pytest.approx(0.020 + 0.0005 * 2)
    assert choice.added_seconds == pytest.approx([0.0005 * 2, 0.0])
    assert choice.draft_seconds == pytest.approx(0.0005 * 2)


def test_prompt_work_riding_in_the_step_does_not_make_drafts_look_cheap():
    """A step's prompt chunks are done whatever is verified: drafts must beat plain decoding, not a step
    made slow by a prompt (beside 512 prompt tokens, 0.027 of a token would pay for a 0.5 ms draft token)."""
    drafts = [DraftTree.chain([7] * 8, [0.3] * 8)] * 8
    alone = choose_drafts(drafts, [0] * 8, CHEAP).lengths
    beside_a_prompt = choose_drafts(drafts, [0] * 8, CHEAP, step_tokens=8 + 512).lengths
    assert alone == beside_a_prompt == [1] * 8


def test_what_every_step_costs_besides_its_forward_makes_a_draft_token_worth_more():
    """Planning, committing and streaming take a plain step too: a draft token's price is a smaller share of
    the whole step than of its forward alone."""
    pays_on_the_forward_alone = 0.0005 / 0.0205 * (1 + DRAFT_MARGIN)
    draft = [DraftTree.chain([7], [pays_on_the_forward_alone * 0.8])]
    assert choose_drafts(draft, [0], CHEAP).lengths == [0]
    with_host = choose_drafts(draft, [0], CHEAP, host_seconds=0.010)
    assert with_host.lengths == [1]
    assert with_host.plain_seconds == pytest.approx(0.0205 + 0.010)


def test_a_tree_keeps_its_first_nodes_up_to_the_last_that_pays():
    # root ─┬─ 0 (0.6) ── 2 (0.9) ── 4 (0.9)
    #       └─ 1 (0.3) ── 3 (0.05)        reaches: 0.6, 0.3, 0.54, 0.015, 0.486
    tree = DraftTree((5, 6, 7, 8, 9), (-1, -1, 0, 1, 2), (0.6, 0.3, 0.9, 0.05, 0.9))
    assert lengths([tree]) == [5]  # node 4 pays, and node 3 comes before it: a tree is cut after its last node
    best_first = DraftTree((5, 6, 7, 9, 8), (-1, -1, 0, 2, 1), (0.6, 0.3, 0.9, 0.9, 0.05))
    assert lengths([best_first]) == [4]  # a drafter that sends nodes best first has only what pays verified


def test_a_tree_node_costs_by_its_depth_not_its_place_in_the_list():
    cost = StepCostModel()
    for cached in (0, 1000, 4000):
        for tokens in (1, 8, 64):
            shape = StepShape.of([(cached, tokens)])
            cost.observe(shape, 0.020 + 0.0005 * tokens + 0.00000025 * shape.pairs, profile=True)
    wide = DraftTree((1, 2, 3, 4), (-1, -1, -1, -1), (0.2, 0.2, 0.2, 0.2))
    choice = choose_drafts([wide], [4000], cost.quiet)
    assert choice.added_seconds[0] == pytest.approx(4 * cost.token_seconds(4001, step_tokens=1))



def test_a_step_with_nothing_to_price_chooses_nothing_even_when_the_fit_went_to_zero():
    degenerate = StepCostModel()
    for tokens in (1, 8, 64):  # a start-up profile on a machine too busy to time it
        degenerate.observe(StepShape.of([(0, tokens)]), 0.0, profile=True)
    empty = StepShape.of([])  # every decode preempted, no prompt admitted
    assert degenerate.predict(empty) == 0.0
    choice = choose_drafts([], [], degenerate.quiet)
    assert choice.lengths == [] and choice.expected_tokens == 0
