"""The draft-length policy: draft only as many tokens as are expected to pay."""
import pytest

from drafter_svc.draft_length import DraftLengthPolicy, best_draft_length, prior_acceptance
from drafter_svc.sequences import AcceptanceHistory

policy = DraftLengthPolicy(draft_token_cost=0.04)


def test_no_draft_when_acceptance_is_below_the_cost_of_a_draft_token():
    assert best_draft_length(0.03, max_tokens=8, draft_token_cost=0.04) == 0
    assert best_draft_length(0.05, max_tokens=8, draft_token_cost=0.04) == 1


def test_drafts_grow_with_acceptance():
    lengths = [best_draft_length(a / 20, 16, 0.04) for a in range(20)]
    assert lengths == sorted(lengths) and lengths[0] == 0 and lengths[-1] == 16


def test_costlier_verification_means_shorter_drafts():
    assert best_draft_length(0.7, 16, 0.02) > best_draft_length(0.7, 16, 0.04) > best_draft_length(0.7, 16, 0.2)


@pytest.mark.parametrize("acceptance", [0.0, 0.5, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("k", [0, 1, 3, 16])
def test_never_above_k(acceptance, k):
    assert 0 <= best_draft_length(acceptance, k, 0.04) <= k


def test_longer_matches_are_trusted_more_at_first():
    assert [prior_acceptance(n) for n in (1, 2, 3, 5)] == sorted(prior_acceptance(n) for n in (1, 2, 3, 5))
    fresh = AcceptanceHistory()
    assert policy.draft_length(fresh, match_length=1, max_tokens=16) < policy.draft_length(fresh, 5, 16)


def test_high_acceptance_gives_long_drafts():
    history = AcceptanceHistory()
    for _ in range(10):
        history.record(accepted=8, rejected=False)
    assert policy.draft_length(history, match_length=2, max_tokens=8) == 8
    assert policy.draft_length(history, match_length=2, max_tokens=16) >= 12


def drafts_while_rejected(history, steps, match_length=3):
    lengths = []
    for _ in range(steps):
        lengths.append(policy.draft_length(history, match_length, max_tokens=8))
        history.record(accepted=0, rejected=True)
    return lengths


def test_repeated_rejections_shrink_drafts_to_none():
    lengths = drafts_while_rejected(AcceptanceHistory(), steps=15)
    assert lengths[0] >= 2
    assert lengths == sorted(lengths, reverse=True)
    assert lengths[-1] == 0


def test_even_long_matches_stop_drafting_after_enough_rejections():
    assert drafts_while_rejected(AcceptanceHistory(), steps=40, match_length=16)[-1] == 0


def test_drafting_recovers_once_guesses_match_again():
    history = AcceptanceHistory()
    drafts_while_rejected(history, steps=30)
    history.record(accepted=1, rejected=False)  # a plain step confirmed the lookup's guess
    assert policy.draft_length(history, 3, 8) >= 1
    for _ in range(5):
        history.record(accepted=3, rejected=False)
    assert policy.draft_length(history, 3, 8) >= 4
