"""How much of each draft a step verifies: the draft tokens that raise the batch's goodput.

A draft token is worth its reach: the chance that it and every draft token before it are accepted,
the product of the drafter's per-token estimates p_1·p_2·…·p_i. A step that verifies draft tokens
with reaches r yields (decodes + Σ r) tokens in cost(tokens) seconds (`StepCostModel`). The target
adds the candidate tokens in order of falling reach (a prefix of each draft, since reach only falls
along a draft) and keeps the count that maximises tokens per second: with many sequences in the
batch a draft token must carry more of a token to pay for itself, and at high load none does.
"""
from __future__ import annotations

from dataclasses import dataclass

from target_svc.cost_model import StepCostModel, StepShape


@dataclass(frozen=True)
class DraftChoice:
    lengths: list[int]  # draft tokens kept per candidate, in order
    expected_tokens: float  # tokens the step is expected to yield for its decodes
    seconds: float  # the step's predicted cost


def choose_drafts(candidates: list[list[float]], base: StepShape, cost: StepCostModel) -> DraftChoice:
    """Per candidate draft (one per decoding sequence, as its tokens' acceptance estimates; empty for
    none), how many of its tokens to verify in a step whose other work is `base` (the decodes' newest
    tokens, prompt chunks)."""
    reaches = []  # (reach, candidate, position)
    for index, probs in enumerate(candidates):
        reach = 1.0
        for position, prob in enumerate(probs):
            reach *= prob
            reaches.append((reach, index, position))
    reaches.sort(key=lambda r: -r[0])  # stable: equal reaches keep draft order, so each draft stays a prefix
    base_seconds, per_token = cost.predict(base), cost.coefficients[1]  # the cost is linear in the tokens
    expected = float(len(candidates))
    best_count, best_value, best_expected = 0, expected / base_seconds, expected
    for count, (reach, _, _) in enumerate(reaches, start=1):
        expected += reach
        value = expected / (base_seconds + per_token * count)
        if value > best_value:
            best_count, best_value, best_expected = count, value, expected
    lengths = [0] * len(candidates)
    for _, index, position in reaches[:best_count]:
        lengths[index] = max(lengths[index], position + 1)
    return DraftChoice(lengths, best_expected, base_seconds + per_token * best_count)
