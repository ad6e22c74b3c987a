"""How much of each draft a step verifies: the draft tokens that raise the batch's goodput.

A draft token (a node of the draft tree) is worth its reach: the chance that it and every ancestor
are accepted, the product of the drafter's per-token estimates along its path (`DraftTree.reaches`),
and costs what it adds to the step (`Fit.token_seconds` of the start-up profile's fit, `StepCostModel.quiet`,
which prices the decodes too: more in a long sequence, whose keys it attends over, deeper in the tree,
and past the knees the step's other work has reached). Decoding
that verifies draft tokens with reaches r yields (decodes + Σ r) tokens in (plain + Σ cost) seconds,
where plain is what a step of the decodes' newest tokens alone costs (its forward, and the planning,
committing and streaming every step takes besides: ~1 ms, ~8% of a step at batch 1, so a draft token's price is
a smaller share of the step than of its forward alone): the step's prompt chunks are work the
target does whatever it verifies, so they are not part of what drafts must beat. (Counted in, they
made a step carrying a prompt look slow, and any draft look cheap beside it: at 32 clients on unseen
text `auto` verified drafts that were 39% accepted and ran at 0.85x `none`.) The target adds the
candidate tokens in order of falling reach per second and keeps the count that maximises tokens per
second, each draft token priced DRAFT_MARGIN above its cost so that it must pay with some to spare:
with many sequences in the batch a draft token must carry more of a token to pay for itself, and at
high load none does. What a draft keeps is its first nodes up to the last one taken (parents come
before children, so that is still a tree; drafters send nodes best first, so it is what was taken).
"""
from __future__ import annotations

from dataclasses import dataclass

from specd.drafts import DraftTree
from target_svc.cost_model import Fit, StepShape


MIN_SECONDS = 1e-9
# A draft token is kept only if it pays for itself with this much to spare: what it costs beyond the
# cost model's price (the drafters' and the verification's CPU time on the same cores; the linear
# price of an extra token runs a few percent under its real cost in a full step) would otherwise turn
# a predicted small gain into a loss, and under load, where a draft token costs nearly what a decoded
# one does, every gain is small. With one sequence, where a draft token costs a few percent of a step,
# it changes almost nothing. (Measured with `ngram`, bf16, one pass of 128 Spec-Bench prompts on a 2-core
# EPYC: at 16 clients 0.98x `none`'s tokens per second without a margin, 1.01x with 0.25 or 0.5; at 64
# clients 0.96x with 0.25, 1.00x with 0.5.)
DRAFT_MARGIN = 0.5


@dataclass(frozen=True)
class DraftChoice:
    lengths: list[int]  # draft tokens kept per candidate, in order
    expected_tokens: float  # tokens the step is expected to yield for its decodes
    plain_seconds: float  # the predicted cost of a step of the decodes' newest tokens alone
    added_seconds: list[float]  # what each candidate's kept draft tokens add to the step

    @property
    def draft_seconds(self) -> float:
        """What the kept draft tokens add to the step."""
        return sum(self.added_seconds)


def choose_drafts(candidates: list[DraftTree], cached: list[int], cost: Fit,
                  step_tokens: int | None = None, host_seconds: float = 0.0) -> DraftChoice:
    """Per candidate draft (one per decoding sequence; empty for none), how many of its first nodes to
    verify. `cached`: each candidate's sequence's cached tokens before the step (its newest token goes at
    that position, the draft after it). `step_tokens`: the new tokens the step carries besides the drafts
    (the decodes' newest tokens, windows, prompt chunks; by default the newest tokens alone), which place
    the drafts' tokens past the cost model's knees or not. `host_seconds`: what a step costs beside its
    forward (planning, committing, streaming), which the plain step costs too."""
    plain = StepShape.of((start, 1) for start in cached)
    step_tokens = plain.tokens if step_tokens is None else step_tokens
    tokens = []  # (reach, position, candidate, node)
    for index, (draft, start) in enumerate(zip(candidates, cached)):
        for node, (reach, depth) in enumerate(zip(draft.reaches(), draft.depths())):
            tokens.append((reach, start + depth, index, node))
    # Ranked by reach per second at the price of a token past the knee (where a token's price differs by
    # its position alone); a fit gone to zero (a noisy start-up profile) prices everything at nothing:
    # floored, the arithmetic stays defined and a free draft token is kept.
    tokens.sort(key=lambda t: -t[0] / max(cost.token_seconds(t[1], step_tokens + len(tokens)), MIN_SECONDS))
    plain_seconds = cost.predict(plain) + host_seconds
    # Each token in turn adds its price at the step's size so far: the first few ride below the knee.
    prices = cost.token_prices((position for _, position, _, _ in tokens), step_tokens)
    expected, seconds = float(len(candidates)), max(plain_seconds, MIN_SECONDS)
    best_count, best_value = 0, expected / seconds
    for count, ((reach, _, _, _), price) in enumerate(zip(tokens, prices), start=1):
        expected, seconds = expected + reach, seconds + (1 + DRAFT_MARGIN) * price
        if expected / seconds > best_value:
            best_count, best_value = count, expected / seconds
    lengths = [0] * len(candidates)
    for _, _, index, node in tokens[:best_count]:
        lengths[index] = max(lengths[index], node + 1)
    expected, added = float(len(candidates)), [0.0] * len(candidates)
    for (reach, _, index, node), price in zip(tokens, prices):  # what the kept nodes yield and cost
        if node < lengths[index]:
            expected += reach
            added[index] += price
    return DraftChoice(lengths, expected, plain_seconds, added)
