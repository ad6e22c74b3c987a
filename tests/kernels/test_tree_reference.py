"""Tree drafts, specified on the PyTorch reference: greedy acceptance, attention mask and positions."""
import pytest
import torch

from kernels import build_tree_attention, greedy_accept, tree_greedy_accept, tree_mask_offsets
from kernels.testing import random_batch


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()], dtype=torch.long)


def _t(values):
    return torch.tensor(values, dtype=torch.long)


def _accept(drafts, parents, lengths, argmax):
    num_accepted, accepted_nodes, next_token = tree_greedy_accept(_t(drafts), _t(parents), _cu(lengths), _t(argmax))
    return num_accepted.tolist(), accepted_nodes.tolist(), next_token.tolist()


def test_tree_accepts_the_branch_that_follows_the_argmax():
    # root ─┬─ 0:5 ── 3:8
    #       └─ 1:6 ── 2:7        target rows: root, node 0, node 1, node 2, node 3
    assert _accept([5, 6, 7, 8], [-1, -1, 1, 0], [4], [6, 0, 7, 9, 0]) == ([2], [1, 2, -1, -1], [9])


def test_tree_whose_root_children_all_miss_accepts_nothing_and_corrects_at_the_root():
    assert _accept([5, 6, 7], [-1, -1, 0], [3], [4, 7, 0, 0]) == ([0], [-1, -1, -1], [4])


def test_tree_keeps_the_deepest_accepted_path_not_the_first():
    # Two root children carry the same token: the second branch goes deeper.
    drafts, parents = [5, 6, 5, 6, 7], [-1, 0, -1, 2, 3]
    argmax = [5, 6, 0, 6, 7, 1]  # rows: root, nodes 0..4
    assert _accept(drafts, parents, [5], argmax) == ([3], [2, 3, 4, -1, -1], [1])


def test_tree_breaks_ties_between_equally_deep_paths_by_the_lowest_node():
    assert _accept([5, 5], [-1, -1], [2], [5, 8, 9]) == ([1], [0, -1], [8])


def test_a_chain_is_a_tree_of_consecutive_parents():
    b = random_batch([16, 0, 5, 9, 1], 4)
    num_accepted, accepted_nodes, next_token = tree_greedy_accept(
        b.draft_token_ids, b.parent_ids, b.cu_draft_lens, b.target_argmax)
    assert (num_accepted.tolist(), next_token.tolist()) == tuple(
        t.tolist() for t in greedy_accept(b.draft_token_ids, b.cu_draft_lens, b.target_argmax))
    for first, n in zip(b.cu_draft_lens.tolist(), num_accepted.tolist()):
        assert accepted_nodes[first:first + n].tolist() == list(range(n))


def test_tree_batch_keeps_each_sequence_in_its_own_slots_and_rows():
    # Sequence 0: root ── 0:3 (accepted). Sequence 1: no drafts.
    # Sequence 2: root ─┬─ 0:4
    #                   └─ 1:5 (accepted)
    result = _accept([3, 4, 5], [-1, -1, -1], [1, 0, 2], [3, 8, 2, 5, 0, 6])
    assert result == ([1, 0, 1], [0, 1, -1], [8, 2, 6])


def test_parents_must_come_before_their_children():
    with pytest.raises(ValueError, match="earlier node"):
        tree_greedy_accept(_t([1, 2]), _t([1, -1]), _cu([2]), _t([0, 0, 0]))


def _blocks(tree_mask, lengths):
    offsets = tree_mask_offsets(_cu(lengths)).tolist()
    return [tree_mask[offsets[b]:offsets[b + 1]].view(n + 1, n + 1).int().tolist() for b, n in enumerate(lengths)]


def test_each_row_sees_its_ancestors_and_itself():
    # root ─┬─ 0 ── 2
    #       └─ 1
    positions, tree_mask = build_tree_attention(_t([-1, -1, 0]), _cu([3]), _t([10]))
    assert positions.tolist() == [10, 11, 11, 12]
    assert _blocks(tree_mask, [3]) == [[[1, 0, 0, 0],
                                        [1, 1, 0, 0],
                                        [1, 0, 1, 0],
                                        [1, 1, 0, 1]]]


def test_a_chain_mask_is_causal():
    positions, tree_mask = build_tree_attention(_t([-1, 0, 1]), _cu([3]), _t([7]))
    assert positions.tolist() == [7, 8, 9, 10]
    assert _blocks(tree_mask, [3]) == [torch.ones(4, 4).tril().int().tolist()]


def test_batch_mask_holds_one_block_per_sequence_and_positions_follow_each_start():
    positions, tree_mask = build_tree_attention(_t([-1, -1]), _cu([2, 0]), _t([4, 9]))
    assert positions.tolist() == [4, 5, 5, 9]
    assert tree_mask.numel() == 3 * 3 + 1 * 1
    assert _blocks(tree_mask, [2, 0]) == [[[1, 0, 0], [1, 1, 0], [1, 0, 1]], [[1]]]
