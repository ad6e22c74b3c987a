"""What the drafter keeps per sequence: its committed tokens, kept in sync with
the target by idempotent updates, and how well recent drafts fared. The registry
of them is bounded, because the target's Release may never arrive (it died)."""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from specd import defaults
from specd.errors import InvalidArgument, check_length
from specd.limits import MAX_CORPUS_SCOPE_CHARS, MAX_DRAFTER_SEQUENCE_TOKENS, MAX_SEQUENCE_ID_CHARS
from specd.v1 import drafter_pb2


# Bytes per value of each dtype features may come in.
FEATURE_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
MAX_HIDDEN_SIZE = 65536


@dataclass(frozen=True)
class FeaturesUpdate:
    """The target's features of consecutive tokens from `start_position` on, as it sent them (the proposer
    that drafts from them decodes the bytes)."""
    start_position: int
    hidden_size: int
    dtype: str
    data: bytes

    @property
    def rows(self) -> int:
        return len(self.data) // (self.hidden_size * FEATURE_DTYPE_BYTES[self.dtype])

    @classmethod
    def from_pb(cls, pb: drafter_pb2.Features, field_prefix: str) -> FeaturesUpdate:
        if pb.dtype not in FEATURE_DTYPE_BYTES:
            raise InvalidArgument(f"{field_prefix}.dtype", f"must be one of {', '.join(FEATURE_DTYPE_BYTES)}, "
                                  f"got {pb.dtype!r}")
        if not 0 < pb.hidden_size <= MAX_HIDDEN_SIZE:
            raise InvalidArgument(f"{field_prefix}.hidden_size",
                                  f"must be in 1..{MAX_HIDDEN_SIZE}, got {pb.hidden_size}")
        if pb.start_position < 0:
            raise InvalidArgument(f"{field_prefix}.start_position", f"must be >= 0, got {pb.start_position}")
        if len(pb.data) % (pb.hidden_size * FEATURE_DTYPE_BYTES[pb.dtype]):
            raise InvalidArgument(f"{field_prefix}.data", f"{len(pb.data)} bytes are not whole rows of "
                                  f"{pb.hidden_size} {pb.dtype} values")
        return cls(pb.start_position, pb.hidden_size, pb.dtype, pb.data)


def check_token_ids(field_name: str, token_ids, vocab_size: int) -> None:
    """Every id in `token_ids` is in the vocabulary, 0..vocab_size-1; else InvalidArgument naming the first
    one outside it."""
    if token_ids and not (0 <= min(token_ids) and max(token_ids) < vocab_size):
        index, token_id = next((i, t) for i, t in enumerate(token_ids) if not 0 <= t < vocab_size)
        raise InvalidArgument(f"{field_name}[{index}]",
                              f"token id {token_id} is outside the vocabulary (0..{vocab_size - 1})")


@dataclass(frozen=True)
class SequenceUpdate:
    """Committed tokens from `start_position` on, as the target last saw them."""
    sequence_id: str
    start_position: int
    appended_token_ids: list[int]
    prompt_length: int = 0  # from position 0 only: how many of the tokens are the prompt
    features: FeaturesUpdate | None = None  # to drafters that draft from the target's features
    corpus_scope: str = ""  # from position 0 only: whose outputs a learning drafter drafts it from

    @classmethod
    def from_pb(cls, pb: drafter_pb2.SequenceUpdate, field_prefix: str, vocab_size: int) -> SequenceUpdate:
        """The update, checked: its token ids in 0..vocab_size-1 (the target's vocabulary) among the rest."""
        if not pb.sequence_id:
            raise InvalidArgument(f"{field_prefix}.sequence_id", "must not be empty")
        check_length(f"{field_prefix}.sequence_id", pb.sequence_id, MAX_SEQUENCE_ID_CHARS, "characters")
        if pb.start_position < 0:
            raise InvalidArgument(f"{field_prefix}.start_position", f"must be >= 0, got {pb.start_position}")
        if pb.start_position + len(pb.appended_token_ids) > MAX_DRAFTER_SEQUENCE_TOKENS:
            raise InvalidArgument(f"{field_prefix}.appended_token_ids",
                                  f"a sequence holds at most {MAX_DRAFTER_SEQUENCE_TOKENS} tokens, this one would "
                                  f"hold {pb.start_position + len(pb.appended_token_ids)}")
        check_token_ids(f"{field_prefix}.appended_token_ids", pb.appended_token_ids, vocab_size)
        if pb.start_position == 0 and not 0 <= pb.prompt_length <= len(pb.appended_token_ids):
            raise InvalidArgument(f"{field_prefix}.prompt_length", f"must be in 0..{len(pb.appended_token_ids)} "
                                  f"(the tokens sent), got {pb.prompt_length}")
        check_length(f"{field_prefix}.corpus_scope", pb.corpus_scope, MAX_CORPUS_SCOPE_CHARS, "characters")
        features = FeaturesUpdate.from_pb(pb.features, f"{field_prefix}.features") if pb.HasField("features") else None
        return cls(pb.sequence_id, pb.start_position, list(pb.appended_token_ids), pb.prompt_length, features,
                   pb.corpus_scope)


@dataclass
class AcceptanceHistory:
    """Accepted draft positions and rejections, weighted toward recent steps.

    A step whose draft matched m positions and then missed records m accepted
    and 1 rejected, so accepted / (accepted + rejected) estimates the chance
    that the next draft position is accepted given the previous one was.
    """
    accepted: float = 0.0
    rejected: float = 0.0
    # Forget old evidence (a window of ~20 steps) so the estimate follows the text as it changes.
    decay: float = 0.95

    def record(self, accepted: int, rejected: bool) -> None:
        self.accepted = self.accepted * self.decay + accepted
        self.rejected = self.rejected * self.decay + rejected


class SequenceState:
    def __init__(self, sequence_id: str):
        self.sequence_id = sequence_id
        self.tokens: list[int] = []
        self.last_used_at = 0.0
        # Bumped whenever held tokens are dropped or replaced, so incremental indexes know to rebuild.
        self.epoch = 0
        self.acceptance = AcceptanceHistory()
        self.options: dict[str, Any] = {}  # the method's options for this sequence, resolved once
        self.prompt_length = 0  # the first tokens that are the prompt (the rest its output so far)
        self.corpus_scope = ""  # which requests' outputs it drafts from and teaches (SpeculativeConfig.corpus_scope)
        # Whatever the proposer keeps per sequence (an n-gram index); it lives and dies with the sequence.
        self.proposer_state: Any = None
        # Features received and not yet taken in by the proposer (only for one that drafts from them).
        self.new_features: list[FeaturesUpdate] = []
        self._expected: list[int] = []
        self._expected_at = 0

    def apply(self, start_position: int, appended: list[int]) -> bool:
        """Truncate to `start_position` and append; False (nothing changes) if we hold
        fewer than `start_position` tokens and need the whole sequence again."""
        if start_position > len(self.tokens):
            return False
        held = self.tokens[start_position:start_position + len(appended)]
        if held == appended[:len(held)] and start_position + len(appended) >= len(self.tokens):
            self.tokens.extend(appended[len(held):])  # a re-sent update only adds what we lack
        else:
            del self.tokens[start_position:]
            self.tokens.extend(appended)
            self.epoch += 1
            if start_position < self._expected_at:
                self._expected = []
        self._score_expectation()
        return True

    def expect(self, continuation: list[int]) -> None:
        """Remember what the proposer predicts follows the current tokens. The draft
        sent is a prefix of it (maybe empty); scoring all of it keeps the acceptance
        history learning while drafts are short or withheld."""
        self._expected = continuation
        self._expected_at = len(self.tokens)

    def _score_expectation(self) -> None:
        committed = self.tokens[self._expected_at:self._expected_at + len(self._expected)]
        if not (self._expected and committed):
            return
        accepted = 0
        while accepted < len(committed) and committed[accepted] == self._expected[accepted]:
            accepted += 1
        self.acceptance.record(accepted, rejected=accepted < len(committed))
        self._expected = []


class SequenceRegistry:
    """Every sequence this drafter tracks, by id, least recently used first. Bounded: sequences idle
    for longer than `idle_timeout_s`, and the least recently used ones past `max_sequences` or
    `max_tokens_held`, are evicted (one still running is resent by the target when it asks)."""

    def __init__(self, max_sequences: int = defaults.DRAFTER_MAX_SEQUENCES,
                 max_tokens_held: int = defaults.DRAFTER_MAX_TOKENS_HELD,
                 idle_timeout_s: float = defaults.DRAFTER_IDLE_TIMEOUT_S, clock: Callable[[], float] = time.monotonic):
        self._states: OrderedDict[str, SequenceState] = OrderedDict()
        self.max_sequences = max_sequences
        self.max_tokens_held = max_tokens_held
        self.idle_timeout_s = idle_timeout_s
        self._clock = clock
        self.tokens_held = 0

    def __len__(self) -> int:
        return len(self._states)

    def apply(self, update: SequenceUpdate) -> SequenceState | None:
        """The sequence's state after the update, or None when the target must resend it from position 0."""
        state = self._states.get(update.sequence_id)
        if state is None:
            if update.start_position > 0:  # we never saw it, restarted since, or evicted it
                return None
            state = self._states[update.sequence_id] = SequenceState(update.sequence_id)
        self._states.move_to_end(update.sequence_id)
        state.last_used_at = self._clock()
        held = len(state.tokens)
        applied = state.apply(update.start_position, update.appended_token_ids)
        self.tokens_held += len(state.tokens) - held
        if applied and update.features is not None and update.features.data:
            state.new_features.append(update.features)
        return state if applied else None

    def release(self, sequence_id: str) -> SequenceState | None:
        state = self._states.pop(sequence_id, None)
        if state is not None:
            self.tokens_held -= len(state.tokens)
        return state

    def evict(self) -> list[tuple[SequenceState, str]]:
        """Drop what is over the bounds, oldest first; each dropped state with why ("idle" or "capacity")."""
        evicted, idle_before = [], self._clock() - self.idle_timeout_s
        while self._states:
            oldest = next(iter(self._states.values()))
            if oldest.last_used_at < idle_before:
                reason = "idle"
            elif len(self._states) > self.max_sequences or self.tokens_held > self.max_tokens_held:
                reason = "capacity"
            else:
                break
            evicted.append((self.release(oldest.sequence_id), reason))
        return evicted
