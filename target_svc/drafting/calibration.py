"""How far each drafter's acceptance estimates come true, to correct them before they price drafts.

A drafter estimates each draft token's chance of acceptance, and the target keeps the draft tokens
whose expected yield pays for them (`choose_drafts`); estimates that run high keep tokens that do not
pay. So the target compares, per method, the tokens its verified drafts were expected to yield (the
sum of their reaches) with the tokens accepted, over about RECENT_DRAFTS drafts, and scales the
method's next estimates by that ratio.
"""
from __future__ import annotations

from target_svc.drafting.length import reaches

RECENT_DRAFTS = 256
# Until a method's drafts were expected to yield this many tokens, its estimates are taken as they are.
EVIDENCE_TOKENS = 8.0


def expected_tokens(probs: list[float]) -> float:
    """The tokens a draft is expected to yield: the sum of its tokens' reaches."""
    return sum(reaches(probs))


class AcceptanceCalibration:
    def __init__(self):
        self._expected: dict[str, float] = {}  # per method, a decaying sum
        self._accepted: dict[str, float] = {}

    def observe(self, method: str, probs: list[float], accepted: int) -> None:
        """A verified draft: its tokens' estimates as the drafter sent them, and how many were accepted."""
        keep = 1.0 - 1.0 / RECENT_DRAFTS
        self._expected[method] = self._expected.get(method, 0.0) * keep + expected_tokens(probs)
        self._accepted[method] = self._accepted.get(method, 0.0) * keep + accepted

    def factor(self, method: str) -> float:
        """Accepted over expected tokens of the method's recent drafts; 1 until there is evidence."""
        expected = self._expected.get(method, 0.0)
        return self._accepted[method] / expected if expected >= EVIDENCE_TOKENS else 1.0

    def corrected(self, method: str, probs: list[float]) -> list[float]:
        """`probs` with every reach scaled by the method's factor (a chance stays at most 1)."""
        if not probs:
            return probs
        return [min(1.0, probs[0] * self.factor(method)), *probs[1:]]
