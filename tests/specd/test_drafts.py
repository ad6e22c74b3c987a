"""The one draft type: a token tree with an acceptance estimate per token."""
import pytest

from specd.drafts import DraftTree
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
