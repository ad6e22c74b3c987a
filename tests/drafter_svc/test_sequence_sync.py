"""Keeping the drafter's copy of each sequence in sync with the target, and scoring past drafts."""
from drafter_svc.sequences import SequenceRegistry, SequenceState, SequenceUpdate


def update(start, tokens, sequence_id="s"):
    return SequenceUpdate(sequence_id, start, list(tokens))


def test_a_new_sequence_arrives_from_position_zero():
    registry = SequenceRegistry()
    state = registry.apply(update(0, [1, 2, 3]))
    assert state.tokens == [1, 2, 3] and len(registry) == 1


def test_an_unknown_sequence_past_position_zero_needs_resync():
    registry = SequenceRegistry()
    assert registry.apply(update(5, [6, 7])) is None
    assert len(registry) == 0


def test_an_update_beyond_the_held_tokens_needs_resync_and_changes_nothing():
    registry = SequenceRegistry()
    registry.apply(update(0, [1, 2, 3]))
    assert registry.apply(update(5, [6, 7])) is None
    assert registry.apply(update(0, [1, 2, 3, 4, 5, 6, 7])).tokens == [1, 2, 3, 4, 5, 6, 7]


def test_reapplying_an_update_is_idempotent():
    registry = SequenceRegistry()
    registry.apply(update(0, [1, 2, 3]))
    registry.apply(update(3, [4, 5]))
    state = registry.apply(update(3, [4, 5]))
    assert state.tokens == [1, 2, 3, 4, 5] and state.epoch == 0


def test_an_overlapping_update_appends_only_what_is_new():
    state = SequenceState("s")
    state.apply(0, [1, 2, 3])
    state.apply(1, [2, 3, 4, 5])
    assert state.tokens == [1, 2, 3, 4, 5] and state.epoch == 0


def test_an_update_truncates_to_its_start_position():
    state = SequenceState("s")
    state.apply(0, [1, 2, 3, 4, 5])
    state.apply(2, [9])
    assert state.tokens == [1, 2, 9]
    assert state.epoch == 1  # held tokens were replaced: indexes over them must rebuild


def test_release_forgets_the_sequence():
    registry = SequenceRegistry()
    registry.apply(update(0, [1, 2, 3]))
    assert registry.release("s").tokens == [1, 2, 3]
    assert registry.release("s") is None
    assert registry.apply(update(3, [4])) is None


def sequence_expecting(expected, tokens=(1, 2, 3)):
    state = SequenceState("s")
    state.apply(0, list(tokens))
    state.expect(expected)
    return state


def test_accepted_tokens_are_the_common_prefix_of_the_draft_and_what_was_committed():
    state = sequence_expecting([5, 6, 7])
    state.apply(3, [5, 6, 9])  # two accepted, then the target's recovered token
    assert (state.acceptance.accepted, state.acceptance.rejected) == (2, 1)


def test_a_fully_accepted_draft_records_no_rejection():
    state = sequence_expecting([5, 6])
    state.apply(3, [5, 6, 8])  # the bonus token lies past the draft: nothing to judge
    assert (state.acceptance.accepted, state.acceptance.rejected) == (2, 0)


def test_a_plain_step_still_scores_the_first_drafted_position():
    state = sequence_expecting([5, 6, 7])
    state.apply(3, [5])  # the draft was withheld; the one committed token matches its first position
    assert (state.acceptance.accepted, state.acceptance.rejected) == (1, 0)


def test_a_draft_is_scored_once():
    state = sequence_expecting([5, 6, 7])
    state.apply(3, [5, 9])
    state.apply(3, [5, 9])  # re-sent update
    state.apply(5, [10])
    assert (state.acceptance.accepted, state.acceptance.rejected) == (1, 1)


def test_a_draft_over_replaced_tokens_is_not_scored():
    state = sequence_expecting([5, 6, 7])
    state.apply(1, [8, 8, 5, 6, 7])  # the tokens the draft followed changed
    assert (state.acceptance.accepted, state.acceptance.rejected) == (0, 0)


def test_older_outcomes_weigh_less():
    state = sequence_expecting([5])
    state.apply(3, [9])
    for position in range(4, 14):
        state.expect([5])
        state.apply(position, [5])
    assert state.acceptance.rejected < 1
