"""A sequence's text index: the nodes of a counting suffix tree over the same text, found on demand."""
import random

import pytest

from drafter_svc.proposers.suffix_tree import SuffixTree, speculate
from drafter_svc.proposers.text_index import TextIndex


def shape(node, depth: int) -> dict:
    """A node's children, their counts and theirs, `depth` levels down."""
    if depth == 0:
        return {}
    return {token: (child.count, shape(child, depth - 1)) for token, child in (node.children or {}).items()}


def test_an_added_token_is_found_where_it_occurs():
    index = TextIndex(depth=4)
    index.sync([1, 2, 1, 2, 3])
    assert index.node([1, 2]).count == 2 and index.node([2, 1, 2]).count == 1
    assert sorted(index.node([1]).children) == [2] and sorted(index.node([2]).children) == [1, 3]


def test_a_substring_nothing_follows_or_deeper_than_the_index_is_not_a_node():
    index = TextIndex(depth=3)
    index.sync([1, 2, 1, 2, 3])
    assert index.node([2, 3]) is None  # it ends the text
    assert index.node([9]) is None
    assert index.node([1, 2, 1, 2]) is None  # deeper than the index


def test_syncing_takes_in_only_the_tokens_past_those_held():
    index = TextIndex(depth=4)
    index.sync([1, 2])
    index.sync([1, 2, 1, 2, 5])
    assert index.tokens == [1, 2, 1, 2, 5] and index.node([2]).count == 2
    assert sorted(index.node([1, 2]).children) == [1, 5]


@pytest.mark.parametrize("seed", range(20))
def test_every_node_is_the_suffix_trees_node_of_the_same_text(seed):
    rng = random.Random(seed)
    depth = rng.choice([3, 6, 14, 24])
    text = [rng.randrange(rng.choice([2, 4, 12])) for _ in range(rng.randrange(1, 120))]
    tree, index = SuffixTree(depth), TextIndex(depth)
    tree.add(text)
    index.sync(text)
    for n, node in index.matches(text, longest=depth):
        reference = tree.node(text[-n:])
        assert node.count == reference.count and shape(node, depth) == shape(reference, depth)
    # what the index leaves out, the tree holds nothing to draft from
    found = len(index.matches(text, longest=depth))
    assert all(not (tree.node(text[-n:]).children or {}) for n in range(found + 1, min(depth, len(text)) + 1))
    context = [rng.randrange(4) for _ in range(3)]
    for n, node in index.matches(context, longest=3):
        assert shape(node, depth) == shape(tree.node(context[-n:]), depth)


@pytest.mark.parametrize("tree_mode", [True, False])
def test_drafts_from_the_index_are_the_suffix_trees_drafts(tree_mode):
    rng = random.Random(7)
    text = [rng.randrange(6) for _ in range(400)]
    tree, index = SuffixTree(24), TextIndex(24)
    tree.add(text)
    index.sync(text)
    for n, node in index.matches(text, longest=24):
        expected = speculate(tree.node(text[-n:]), 8, 0.05, tree_mode, 24)
        assert speculate(node, 8, 0.05, tree_mode, 24) == expected
