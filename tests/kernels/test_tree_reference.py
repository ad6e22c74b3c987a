"""Tree drafts, specified on the PyTorch reference: greedy and sampled acceptance, attention mask and positions."""
import pytest
import torch

from kernels import (build_tree_attention, greedy_accept, rejection_sample, tree_greedy_accept, tree_mask_offsets,
                     tree_rejection_sample)
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


def test_sampling_a_chain_as_a_tree_gives_what_chain_sampling_gives():
    b = random_batch([16, 0, 5, 9, 1], 8, seed=3)
    num_accepted, accepted_nodes, next_token = tree_rejection_sample(
        b.draft_token_ids, b.parent_ids, b.cu_draft_lens, b.target_probs, b.uniform_accept, b.uniform_final)
    chain = rejection_sample(b.draft_token_ids, b.cu_draft_lens, b.target_probs, None, b.uniform_accept,
                             b.uniform_final)
    assert (num_accepted.tolist(), next_token.tolist()) == tuple(t.tolist() for t in chain)
    for first, n in zip(b.cu_draft_lens.tolist(), num_accepted.tolist()):
        assert accepted_nodes[first:first + n].tolist() == list(range(n))


def _sample_tree_many(target_probs, drafts, parents, trials, seed=0):
    """Tree rejection sampling of one sequence's tree, `trials` times; the emitted token lists."""
    gen = torch.Generator().manual_seed(seed)
    num_accepted, accepted_nodes, next_token = tree_rejection_sample(
        _t(drafts * trials), _t(parents * trials), _cu([len(drafts)] * trials), target_probs.repeat(trials, 1),
        torch.rand(len(drafts) * trials, generator=gen), torch.rand(trials, generator=gen))
    nodes = accepted_nodes.view(trials, len(drafts)).tolist()
    return [[drafts[i] for i in path[:n]] + [t]
            for path, n, t in zip(nodes, num_accepted.tolist(), next_token.tolist())]


def _empirical(tokens, vocab):
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
    return counts / counts.sum()


def test_sampled_tree_output_follows_the_target_distribution():
    # root ─┬─ 0:1 ── 2:3
    #       ├─ 1:2
    #       └─ 3:1   (a repeated token: it has no mass left once node 0 is rejected)
    vocab, trials = 5, 40000
    p_root = torch.tensor([0.1, 0.35, 0.3, 0.15, 0.1])
    p_node0 = torch.tensor([0.2, 0.1, 0.1, 0.4, 0.2])
    p_other = torch.tensor([0.2] * 5)  # rows of nodes 1, 2 and 3
    target = torch.stack([p_root, p_node0, p_other, p_other, p_other])
    outputs = _sample_tree_many(target, [1, 2, 3, 1], [-1, -1, 0, -1], trials)
    first = _empirical([o[0] for o in outputs], vocab)
    assert (first - p_root.double()).abs().sum() < 0.03  # total variation ~1/sqrt(trials)
    second = _empirical([o[1] for o in outputs if o[0] == 1], vocab)  # after node 0's token, node 0's row
    assert (second - p_node0.double()).abs().sum() < 0.05


def test_a_sampled_tree_never_emits_a_rejected_child_at_its_row():
    # The target rules out token 1 at the root: node 0 is always rejected, and never comes back as the
    # recovered token; node 1 (token 2) is the only other way down.
    target = torch.tensor([[0.0, 0.0, 0.5, 0.5], [0.25] * 4, [1.0, 0.0, 0.0, 0.0]])
    outputs = _sample_tree_many(target, [1, 2], [-1, -1], 4000)
    assert all(o[0] != 1 for o in outputs)
    assert {tuple(o) for o in outputs} == {(2, 0), (3,)}


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
