"""The drafter's per-sequence state stays bounded when Releases never come."""
from drafter_svc.sequences import SequenceRegistry, SequenceUpdate


class Clock:
    """Seconds that move only when a test says so."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def registry(clock=None, **bounds) -> SequenceRegistry:
    return SequenceRegistry(**{"max_sequences": 100, "max_tokens_held": 10_000, "idle_timeout_s": 60.0, **bounds},
                            clock=clock or Clock())


def add(registry, sequence_id, tokens=(1, 2, 3)):
    return registry.apply(SequenceUpdate(sequence_id, 0, list(tokens)))


def test_sequences_idle_past_the_timeout_are_evicted():
    clock = Clock()
    sequences = registry(clock)
    add(sequences, "old")
    clock.now = 30.0
    add(sequences, "recent")
    clock.now = 61.0
    assert [(state.sequence_id, reason) for state, reason in sequences.evict()] == [("old", "idle")]
    assert len(sequences) == 1


def test_the_least_recently_used_go_first_when_over_the_sequence_cap():
    sequences = registry(max_sequences=2)
    for name in ("a", "b", "c"):
        add(sequences, name)
    sequences.apply(SequenceUpdate("a", 3, [4]))  # "a" was used last now
    assert [(state.sequence_id, reason) for state, reason in sequences.evict()] == [("b", "capacity")]


def test_tokens_held_are_counted_and_bounded():
    sequences = registry(max_tokens_held=10)
    add(sequences, "a", range(6))
    add(sequences, "b", range(6))
    assert sequences.tokens_held == 12
    assert [state.sequence_id for state, _ in sequences.evict()] == ["a"]
    assert sequences.tokens_held == 6
    sequences.release("b")
    assert sequences.tokens_held == 0 and len(sequences) == 0


def test_an_evicted_sequence_is_asked_for_again_from_position_zero():
    sequences = registry(max_sequences=1)
    add(sequences, "a")
    add(sequences, "b")
    sequences.evict()
    assert sequences.apply(SequenceUpdate("a", 3, [4])) is None  # the target resends it whole
