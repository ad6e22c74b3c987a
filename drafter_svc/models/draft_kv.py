"""Which of a sequence's tokens a model drafter's KV cache holds, and what it must feed to catch up.

A model drafter writes K/V for the committed tokens and for its own draft tokens. Next step the target
has kept some of those drafts: their K/V stay; the rest is cut off, and only the tokens the cache lacks
are fed again. Committed tokens never change (a resync bumps the sequence's epoch and starts over).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from drafter_svc.sequences import SequenceState
from engine.kv_cache import BlockAllocator


@dataclass
class CachedTokens:
    """What the cache holds for one sequence: its first `committed` tokens, then `drafted` ones."""
    epoch: int
    committed: int = 0
    drafted: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class CatchUp:
    """The tokens to feed (never empty: the last committed token's logits start the draft), from `start`."""
    start: int
    token_ids: list[int]


def catch_up(sequence: SequenceState, allocator: BlockAllocator) -> CatchUp:
    """Cut the sequence's cached K/V back to what is still its text, and say what to feed from there."""
    cached = sequence.proposer_state
    if not isinstance(cached, CachedTokens) or cached.epoch != sequence.epoch:
        allocator.free(sequence.sequence_id)
        cached = sequence.proposer_state = CachedTokens(sequence.epoch)
    tokens = sequence.tokens
    kept = cached.committed + _common_prefix(cached.drafted, tokens[cached.committed:])
    kept = min(kept, len(tokens) - 1)
    allocator.truncate(sequence.sequence_id, kept)
    return CatchUp(kept, tokens[kept:])


def cached(sequence: SequenceState, drafted: list[int]) -> None:
    """After a forward: the cache holds every committed token, then `drafted` (the drafts fed back in)."""
    sequence.proposer_state = CachedTokens(sequence.epoch, len(sequence.tokens), drafted)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
