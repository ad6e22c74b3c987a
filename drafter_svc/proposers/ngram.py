"""n-gram prompt lookup: find the longest suffix of the sequence that occurred
earlier in it and propose the tokens that followed that earlier occurrence, each
with an estimate of its chance of acceptance."""
from __future__ import annotations

from dataclasses import dataclass

from drafter_svc.proposers.base import DraftRequest
from drafter_svc.sequences import AcceptanceHistory, SequenceState
from specd.drafts import DraftTree
from specd.options import Option, OptionSchema

# Longer matches add little evidence, and each n looked up costs an index entry per token,
# so longer prompt_lookup_max values are served as this (rejecting them would fail the whole batch).
LONGEST_NGRAM = 16


@dataclass(frozen=True)
class NgramMatch:
    length: int  # n: how many trailing tokens matched
    continuation: list[int]  # what followed the earlier occurrence


class NgramIndex:
    """Every n-gram of a sequence mapped to where its latest occurrence ends.

    Grows with the sequence (only new positions are indexed, a few per step) and
    leaves out the n-gram ending at the last token, so looking up the suffix
    finds an earlier occurrence. An n is indexed the first time it is asked for.
    """

    def __init__(self, epoch: int = 0):
        self.epoch = epoch  # of the SequenceState tokens it indexes
        # n-grams of every n share one dict: tuples of different lengths never compare equal
        self._latest_end: dict[tuple[int, ...], int] = {}
        self._indexed_until: dict[int, int] = {}  # n -> n-grams ending before this position are indexed

    @classmethod
    def of(cls, sequence: SequenceState, index: NgramIndex | None) -> NgramIndex:
        """`index` where it still indexes `sequence`'s tokens (the same epoch), else a new one for them."""
        return index if index is not None and index.epoch == sequence.epoch else cls(sequence.epoch)

    def longest_match(self, tokens: list[int], min_n: int, max_n: int, limit: int) -> NgramMatch | None:
        """The longest suffix n-gram (max_n down to min_n) seen earlier, at its most recent
        earlier occurrence, with up to `limit` tokens of continuation."""
        for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
            self._index(tokens, n)
            end = self._latest_end.get(tuple(tokens[-n:]))
            if end is not None:
                return NgramMatch(n, _continuation(tokens, end, limit))
        return None

    def _index(self, tokens: list[int], n: int) -> None:
        # n-grams ending (exclusive) at n .. len - 1; a later end overwrites an earlier one
        for end in range(self._indexed_until.get(n, n), len(tokens)):
            self._latest_end[tuple(tokens[end - n:end])] = end
        self._indexed_until[n] = len(tokens)


def _continuation(tokens: list[int], start: int, limit: int) -> list[int]:
    # Copy forward from `start`; once the copy reaches the end of the sequence it
    # continues from its own output (as LZ77 does), so a repeating loop keeps repeating.
    out = tokens[start:start + limit]
    period = len(tokens) - start
    while len(out) < limit:
        out.append(out[len(out) - period])
    return out


def prior_acceptance(match_length: int) -> float:
    """Acceptance we expect before seeing any outcome: n matched tokens count as
    n hits against two misses, so longer n-gram matches are trusted more."""
    return match_length / (match_length + 2)


# Pseudo-observations the match-length prior is worth: small, so the sequence's own record dominates quickly.
PRIOR_WEIGHT = 0.5


def estimated_acceptance(history: AcceptanceHistory, match_length: int) -> float:
    """Posterior mean of the per-position acceptance probability (Beta prior + recent outcomes)."""
    hits = PRIOR_WEIGHT * prior_acceptance(match_length) + history.accepted
    return hits / (PRIOR_WEIGHT + history.accepted + history.rejected)


class NgramProposer:
    """Prompt-lookup chains, every token estimated at the sequence's current acceptance rate."""

    schema = OptionSchema("ngram", (
        Option("prompt_lookup_min", "int", 2, minimum=1, help="shortest suffix n-gram to match"),
        Option("prompt_lookup_max", "int", 5, minimum=1, at_least="prompt_lookup_min",
               help=f"longest suffix n-gram to match (served as at most {LONGEST_NGRAM})"),
    ))

    def propose(self, batch: list[DraftRequest]) -> list[DraftTree]:
        return [self._propose_one(request) for request in batch]

    def release(self, sequence: SequenceState) -> None:
        """Nothing to learn across sequences; the index goes with the sequence's state."""

    def _propose_one(self, request: DraftRequest) -> DraftTree:
        seq, options = request.sequence, request.options
        index = seq.proposer_state = NgramIndex.of(seq, seq.proposer_state)
        match = index.longest_match(seq.tokens, min(options["prompt_lookup_min"], LONGEST_NGRAM),
                                    min(options["prompt_lookup_max"], LONGEST_NGRAM), request.max_tokens)
        if match is None or not match.continuation:
            return DraftTree()
        seq.expect(match.continuation)
        acceptance = estimated_acceptance(seq.acceptance, match.length)
        return DraftTree.chain(match.continuation, [acceptance] * len(match.continuation))
