"""How much of each draft a step verifies: the draft tokens that raise the batch's goodput.

A draft token is worth its reach: the chance that it and every draft token before it are accepted,
the product of the drafter's per-token estimates p_1·p_2·…·p_i, and costs what it adds to the step
(`StepCostModel.token_seconds`: more in a long sequence, whose keys it attends over). A step that
verifies draft tokens with reaches r yields (decodes + Σ r) tokens in (base + Σ cost) seconds. The
target adds the candidate tokens in order of falling reach per second (a prefix of each draft, since
along a draft reach only falls and cost only rises) and keeps the count that maximises tokens per
second: with many sequences in the batch a draft token must carry more of a token to pay for itself,
and at high load none does.
"""
from __future__ import annotations

from dataclasses import dataclass

from target_svc.cost_model import StepCostModel, StepShape


@dataclass(frozen=True)
class DraftChoice:
    lengths: list[int]  # draft tokens kept per candidate, in order
    expected_tokens: float  # tokens the step is expected to yield for its decodes
    base_seconds: float  # the step's predicted cost without drafts
    added_seconds: list[float]  # what each candidate's kept draft tokens add to it

    @property
    def draft_seconds(self) -> float:
        """What the kept draft tokens add to the step."""
        return sum(self.added_seconds)

    @property
    def seconds(self) -> float:
        """The step's predicted cost."""
        return self.base_seconds + self.draft_seconds


def reaches(probs: list[float]) -> list[float]:
    """Each draft token's chance that it and every token before it are accepted: p_1, p_1·p_2, ..."""
    out, reach = [], 1.0
    for prob in probs:
        reach *= prob
        out.append(reach)
    return out


def choose_drafts(candidates: list[list[float]], cached: list[int], base: StepShape,
                  cost: StepCostModel) -> DraftChoice:
    """Per candidate draft (one per decoding sequence, as its tokens' acceptance estimates; empty for
    none), how many of its tokens to verify in a step whose other work is `base` (the decodes' newest
    tokens, prompt chunks). `cached`: each candidate's sequence's cached tokens before the step (its
    newest token goes at that position, the draft after it)."""
    tokens = []  # (reach, seconds, candidate, position in the draft)
    for index, (probs, start) in enumerate(zip(candidates, cached)):
        for position, reach in enumerate(reaches(probs)):
            tokens.append((reach, cost.token_seconds(start + 1 + position), index, position))
    tokens.sort(key=lambda t: -t[0] / t[1])  # stable: equal ratios keep draft order, so each draft stays a prefix
    base_seconds = cost.predict(base)
    expected, seconds = float(len(candidates)), base_seconds
    best_count, best_value, best_expected = 0, expected / seconds, expected
    for count, (reach, token_seconds, _, _) in enumerate(tokens, start=1):
        expected, seconds = expected + reach, seconds + token_seconds
        if expected / seconds > best_value:
            best_count, best_value, best_expected = count, expected / seconds, expected
    lengths, added = [0] * len(candidates), [0.0] * len(candidates)
    for _, token_seconds, index, position in tokens[:best_count]:
        lengths[index] = max(lengths[index], position + 1)
        added[index] += token_seconds
    return DraftChoice(lengths, best_expected, base_seconds, added)
