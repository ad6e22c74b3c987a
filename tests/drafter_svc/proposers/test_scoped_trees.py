"""Suffix trees by corpus scope: one node count over them all, and a scope's tree only while it holds any."""
from drafter_svc.proposers.scoped_trees import ScopedTrees
from drafter_svc.proposers.suffix_tree import SuffixTree


def test_a_scopes_tree_is_made_at_its_first_change_and_counted_with_every_other_scopes():
    trees = ScopedTrees(lambda: SuffixTree(depth=4))
    assert trees.get("a") is None and len(trees) == 0
    trees.change("a", lambda tree: tree.add([1, 2, 3]))
    trees.change("b", lambda tree: tree.add([7, 8]))
    assert len(trees) == 2
    assert trees.num_nodes == trees.get("a").num_nodes + trees.get("b").num_nodes > 0
    assert trees.get("a").node([1, 2]) is not None and trees.get("b").node([1, 2]) is None


def test_a_tree_left_empty_goes_and_its_nodes_leave_the_count():
    trees = ScopedTrees(lambda: SuffixTree(depth=4))
    trees.change("a", lambda tree: tree.add([1, 2, 3]))
    trees.change("b", lambda tree: tree.add([7, 8]))
    b_nodes = trees.get("b").num_nodes
    trees.change("a", lambda tree: tree.remove([1, 2, 3]))
    assert trees.get("a") is None and list(trees.scopes()) == ["b"] and trees.num_nodes == b_nodes
    trees.change("c", lambda tree: None)  # a change that adds nothing leaves no tree behind
    assert trees.get("c") is None
