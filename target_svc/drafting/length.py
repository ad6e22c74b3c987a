"""How much of a draft to verify: only as much as is expected to pay for its verification.

Verifying 1 + d tokens costs about (1 + c·d) plain decoding steps (c ≈ 0.12 for specd's runner on
the 2-core CPU we measured: benchmarks/step_cost.py). If draft token i is accepted with probability
p_i once the one before it was (the drafter's estimate), a step yields 1 + p_1 + p_1·p_2 + … tokens.
We verify the prefix that maximises tokens per unit cost; none at all yields 1 per 1.
"""
from __future__ import annotations

from collections.abc import Sequence

from specd.drafts import DraftTree

DEFAULT_DRAFT_TOKEN_COST = 0.12


def best_draft_length(probs: Sequence[float], draft_token_cost: float) -> int:
    """The d in 0..len(probs) that maximises (1 + p_1 + p_1·p_2 + … ) / (1 + c·d); ties go to the shorter."""
    best_length, best_value = 0, 1.0
    expected_tokens, reach = 1.0, 1.0
    for length, prob in enumerate(probs, start=1):
        reach *= prob
        expected_tokens += reach
        value = expected_tokens / (1.0 + draft_token_cost * length)
        if value > best_value:
            best_length, best_value = length, value
    return best_length


def worth_verifying(draft: DraftTree, draft_token_cost: float) -> list[int]:
    """The draft tokens to verify this step: the draft's first path, cut where it stops paying.
    (Whole trees are verified once the tree-verification issue lands.)"""
    path = draft.first_path()
    return list(path.token_ids[:best_draft_length(path.probs, draft_token_cost)])
