"""The one draft type: a token tree with an acceptance estimate per token."""
import pytest

from specd.drafts import ROOT, DraftTree
from specd.errors import InvalidArgument


def test_a_chain_is_a_tree_whose_every_node_has_one_child():
    chain = DraftTree.chain([7, 8, 9], [0.5, 0.5, 0.5])
    assert chain.parents == (-1, 0, 1) and chain.is_chain
    assert not DraftTree((7, 8), (-1, -1), (1.0, 1.0)).is_chain


def test_truncating_keeps_a_tree_because_parents_come_first():
    tree = DraftTree((1, 2, 3, 4), (-1, 0, -1, 2), (1.0,) * 4)
    assert tree.truncated(3) == DraftTree((1, 2, 3), (-1, 0, -1), (1.0,) * 3)
    assert tree.first_path() == [1, 2]


def test_a_nodes_reach_is_the_product_of_the_estimates_down_its_path():
    tree = DraftTree((1, 2, 3, 4), (-1, 0, -1, 1), (0.5, 0.5, 0.25, 0.8))
    assert tree.reaches() == pytest.approx([0.5, 0.25, 0.25, 0.2])
    assert tree.depths() == [1, 2, 1, 3]


def test_it_travels_as_a_draft_message_unchanged():
    tree = DraftTree((1, 2, 3), (-1, 0, 0), (0.5, 0.25, 1.0), score=2.0)
    assert DraftTree.from_pb(tree.to_pb("s")) == tree


@pytest.mark.parametrize("tree, field", [
    (DraftTree((1, 2), (-1, 1), (1.0, 1.0)), "draft.parent_ids[1]"),
    (DraftTree((1, 2), (-1, -2), (1.0, 1.0)), "draft.parent_ids[1]"),
    (DraftTree((1, 2), (-1,), (1.0, 1.0)), "draft.parent_ids"),
    (DraftTree((1,), (-1,), (1.5,)), "draft.probs"),
])
def test_a_malformed_tree_is_refused_naming_the_field(tree, field):
    with pytest.raises(InvalidArgument) as error:
        tree.validate("draft")
    assert error.value.field == field


def paths_of(tree: DraftTree) -> dict[tuple[int, ...], float]:
    """Each node as the path of tokens from the root, with its estimate."""
    return dict(zip(tree.paths(), tree.probs))


def test_a_nodes_path_is_its_tokens_from_the_root_down_to_it():
    tree = DraftTree((5, 6, 7, 8), (-1, 0, -1, 1), (0.5, 0.5, 0.5, 0.5))
    assert tree.paths() == [(5,), (5, 6), (7,), (5, 6, 8)]


def test_merged_trees_share_their_common_paths_once_with_the_higher_estimate():
    ngram = DraftTree.chain([1, 2, 3], [0.6, 0.9, 0.9])
    suffix = DraftTree((1, 2, 7, 4), (ROOT, 0, 1, ROOT), (0.3, 0.95, 0.5, 0.2))
    merged, placement = DraftTree.merge([ngram, suffix], max_nodes=16)
    assert paths_of(merged) == pytest.approx({(1,): 0.6, (1, 2): 0.95, (4,): 0.2,
                                              (1, 2, 3): 0.9 / 1.4, (1, 2, 7): 0.5 / 1.4})  # 3 and 7: one chance
    # each input node is found where the merge put it
    assert [merged.token_ids[i] for i in placement[0].values()] == [1, 2, 3]
    assert [merged.token_ids[placement[1][node]] for node in range(4)] == [1, 2, 7, 4]
    # best first, so a cut keeps the likeliest nodes and is still a tree
    assert merged.truncated(2).token_ids == (1, 2)


def test_siblings_sure_of_different_continuations_are_scaled_to_one_chance_in_all():
    merged, _ = DraftTree.merge([DraftTree.chain([1], [0.9]), DraftTree.chain([2], [0.6])], max_nodes=16)
    assert sum(merged.probs) == pytest.approx(1.0)
    assert merged.probs[merged.token_ids.index(1)] == pytest.approx(0.6)


def test_a_merge_over_budget_keeps_the_likeliest_nodes_and_places_only_those():
    merged, placement = DraftTree.merge([DraftTree.chain([1, 2, 3], [0.9, 0.9, 0.9]), DraftTree.chain([5], [0.05])],
                                        max_nodes=3)
    assert merged.token_ids == (1, 2, 3)
    assert placement[1] == {}


def test_a_subtree_of_nodes_whose_parents_are_among_them_is_reindexed():
    tree = DraftTree((1, 2, 3, 4), (ROOT, 0, ROOT, 1), (0.5, 0.6, 0.7, 0.8))
    assert tree.subtree([0, 1, 3]) == DraftTree((1, 2, 4), (ROOT, 0, 1), (0.5, 0.6, 0.8))


def test_matched_follows_the_tokens_that_came_from_the_root_down_the_branch_that_holds_them():
    tree = DraftTree((5, 6, 7, 8), (-1, -1, 1, 2), (0.5, 0.5, 0.9, 0.9))  # 5 | 6 -> 7 -> 8
    assert tree.matched([6, 7, 9, 1]) == 2
    assert tree.matched([6, 7, 8, 1]) == 3
    assert tree.matched([7, 8]) == 0  # not a child of the root
    assert tree.matched([]) == 0 and DraftTree().matched([5]) == 0
