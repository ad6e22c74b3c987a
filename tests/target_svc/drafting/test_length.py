"""The target decides how much of a draft to verify: only as much as is expected to pay."""
import pytest

from specd.drafts import DraftTree
from target_svc.drafting.length import best_draft_length, worth_verifying


def test_no_draft_when_acceptance_is_below_the_cost_of_a_draft_token():
    assert best_draft_length([0.03] * 8, draft_token_cost=0.04) == 0
    assert best_draft_length([0.05] * 8, draft_token_cost=0.04) == 1


def test_longer_drafts_are_verified_as_acceptance_grows():
    lengths = [best_draft_length([a / 20] * 16, 0.04) for a in range(20)]
    assert lengths == sorted(lengths) and lengths[0] == 0 and lengths[-1] == 16


def test_costlier_verification_means_shorter_drafts():
    assert best_draft_length([0.7] * 16, 0.02) > best_draft_length([0.7] * 16, 0.04) > \
        best_draft_length([0.7] * 16, 0.2)


@pytest.mark.parametrize("acceptance", [0.0, 0.5, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("k", [0, 1, 3, 16])
def test_never_more_than_the_draft(acceptance, k):
    assert 0 <= best_draft_length([acceptance] * k, 0.04) <= k


def test_a_draft_is_cut_where_its_estimates_stop_paying():
    assert best_draft_length([0.9, 0.9, 0.01, 0.9], 0.12) == 2


def test_of_a_tree_the_first_path_is_verified():
    # root -> 10 -> 11, and 12 a second child of the root
    tree = DraftTree((10, 11, 12), (-1, 0, -1), (0.9, 0.9, 0.9))
    assert worth_verifying(tree, 0.0) == [10, 11]
    assert worth_verifying(DraftTree.chain([5, 6, 7], [0.9, 0.9, 0.0]), 0.12) == [5, 6]
