"""How far each drafter's acceptance estimates come true, to correct them before they price drafts.

A drafter estimates each draft token's chance of acceptance, and the target keeps the draft tokens
whose expected yield pays for them (`choose_drafts`); estimates that run high keep tokens that do not
pay. So the target compares, per method, the tokens its verified drafts were expected to yield (the
sum of their reaches: `DraftTree.reaches`) with the tokens accepted, over about RECENT_DRAFTS drafts, and scales the
method's next estimates by that ratio.
"""
from __future__ import annotations

from specd.drafts import ROOT, DraftTree

RECENT_DRAFTS = 256
# Pseudo-evidence that a method's estimates are right, worth this many tokens: a few early misses move
# the factor a little, never to zero (a method whose estimates were scaled to nothing would never be
# verified again, and so never be seen to recover).
PRIOR_TOKENS = 8.0


class AcceptanceCalibration:
    def __init__(self):
        self._expected: dict[str, float] = {}  # per method, a decaying sum
        self._accepted: dict[str, float] = {}

    def observe(self, method: str, draft: DraftTree, accepted: int) -> None:
        """A verified draft, its estimates as the drafter sent them, and how many of its tokens were accepted."""
        keep = 1.0 - 1.0 / RECENT_DRAFTS
        self._expected[method] = self._expected.get(method, 0.0) * keep + sum(draft.reaches())
        self._accepted[method] = self._accepted.get(method, 0.0) * keep + accepted

    def factor(self, method: str) -> float:
        """Accepted over expected tokens of the method's recent drafts, PRIOR_TOKENS of them at 1."""
        return (self._accepted.get(method, 0.0) + PRIOR_TOKENS) / (self._expected.get(method, 0.0) + PRIOR_TOKENS)

    def corrected(self, method: str, draft: DraftTree) -> DraftTree:
        """`draft` with every reach scaled by the method's factor (the root's children's estimates scaled;
        a chance stays at most 1)."""
        factor = self.factor(method)
        if factor == 1.0:
            return draft
        return draft.with_probs([min(1.0, prob * factor) if parent == ROOT else prob
                                 for prob, parent in zip(draft.probs, draft.parents)])
