"""How many draft tokens to send: only as many as are expected to pay for their verification.

Verifying 1 + d tokens costs about (1 + c·d) plain decoding steps (c ≈ 0.12 for
specd's runner on the 2-core CPU we measured: benchmarks/step_cost.py), and if each draft position is accepted with probability
a once the previous one was, a step yields 1 + a + a² + … + a^d tokens. We send
the d that maximises tokens per unit cost; d = 0 (no draft) yields 1 per 1.
"""
from __future__ import annotations

from dataclasses import dataclass

from drafter_svc.sequences import AcceptanceHistory


def prior_acceptance(match_length: int) -> float:
    """Acceptance we expect before seeing any outcome: n matched tokens count as
    n hits against two misses, so longer n-gram matches are trusted more."""
    return match_length / (match_length + 2)


def best_draft_length(acceptance: float, max_tokens: int, draft_token_cost: float) -> int:
    """The d in 0..max_tokens that maximises (1 + a + … + a^d) / (1 + c·d); ties go to the shorter draft."""
    best_length, best_value = 0, 1.0
    expected_tokens, term = 1.0, 1.0
    for length in range(1, max_tokens + 1):
        term *= acceptance
        expected_tokens += term
        value = expected_tokens / (1.0 + draft_token_cost * length)
        if value > best_value:
            best_length, best_value = length, value
    return best_length


DEFAULT_DRAFT_TOKEN_COST = 0.12


@dataclass(frozen=True)
class DraftLengthPolicy:
    draft_token_cost: float = DEFAULT_DRAFT_TOKEN_COST
    # Pseudo-observations the match-length prior is worth: small, so the sequence's own record dominates quickly.
    prior_weight: float = 0.5

    def acceptance(self, history: AcceptanceHistory, match_length: int) -> float:
        """Posterior mean of the per-position acceptance probability (Beta prior + recent outcomes)."""
        hits = self.prior_weight * prior_acceptance(match_length) + history.accepted
        return hits / (self.prior_weight + history.accepted + history.rejected)

    def draft_length(self, history: AcceptanceHistory, match_length: int, max_tokens: int) -> int:
        return best_draft_length(self.acceptance(history, match_length), max_tokens, self.draft_token_cost)
