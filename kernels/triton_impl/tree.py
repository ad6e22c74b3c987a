"""Tree drafts in Triton: one program per sequence, walking parent pointers in vector blocks.

Same signatures and outputs as `kernels.reference.tree`. Walks run n steps for
a tree of n nodes (its greatest possible depth), so they end on any input.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.layout import tree_mask_offsets
from kernels.reference.chain import PROB_SCALE
from kernels.triton_impl.chain import draw_in_block

_BLOCK_NODES = 16  # nodes (or rows) walked at once
_BLOCK_ENTRIES = 256  # tree mask entries written at once
_MAX_BLOCK_V = 1024  # vocabulary entries per step of the sampling scans


def tree_greedy_accept(draft_token_ids: torch.Tensor, parent_ids: torch.Tensor, cu_draft_lens: torch.Tensor,
                       target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_seqs = cu_draft_lens.numel() - 1
    num_accepted = torch.empty(num_seqs, dtype=torch.int64, device=cu_draft_lens.device)
    next_token = torch.empty_like(num_accepted)
    accepted_nodes = torch.empty_like(parent_ids)
    if num_seqs:
        _tree_accept_kernel[(num_seqs,)](draft_token_ids, parent_ids, cu_draft_lens, target_argmax, num_accepted,
                                         accepted_nodes, next_token, BLOCK_N=_BLOCK_NODES)
    return num_accepted, accepted_nodes, next_token


def tree_rejection_sample(draft_token_ids: torch.Tensor, parent_ids: torch.Tensor, cu_draft_lens: torch.Tensor,
                          target_probs: torch.Tensor, uniform_accept: torch.Tensor,
                          uniform_final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_seqs = cu_draft_lens.numel() - 1
    num_accepted = torch.empty(num_seqs, dtype=torch.int64, device=cu_draft_lens.device)
    next_token = torch.empty_like(num_accepted)
    accepted_nodes = torch.empty_like(parent_ids)
    target_probs = target_probs.contiguous()
    vocab = target_probs.shape[-1]
    if num_seqs:
        _tree_sample_kernel[(num_seqs,)](draft_token_ids, parent_ids, cu_draft_lens, target_probs, uniform_accept,
                                         uniform_final, num_accepted, accepted_nodes, next_token, vocab,
                                         PROB_SCALE=PROB_SCALE, BLOCK_N=_BLOCK_NODES,
                                         BLOCK_V=min(triton.next_power_of_2(vocab), _MAX_BLOCK_V))
    return num_accepted, accepted_nodes, next_token


def build_tree_attention(parent_ids: torch.Tensor, cu_draft_lens: torch.Tensor,
                         start_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    num_seqs = cu_draft_lens.numel() - 1
    mask_offsets = tree_mask_offsets(cu_draft_lens)
    positions = torch.empty(parent_ids.numel() + num_seqs, dtype=start_positions.dtype, device=parent_ids.device)
    tree_mask = torch.empty(int(mask_offsets[-1]), dtype=torch.bool, device=parent_ids.device)  # syncs: a size
    if num_seqs:
        _tree_attention_kernel[(num_seqs,)](parent_ids, cu_draft_lens, start_positions, mask_offsets, positions,
                                            tree_mask, BLOCK_ROWS=_BLOCK_NODES, BLOCK_ENTRIES=_BLOCK_ENTRIES)
    return positions, tree_mask


@triton.jit
def _tree_accept_kernel(draft_ptr, parent_ptr, cu_ptr, argmax_ptr, num_accepted_ptr, accepted_nodes_ptr,
                        next_token_ptr, BLOCK_N: tl.constexpr):
    seq = tl.program_id(0)
    first = tl.load(cu_ptr + seq)
    num_nodes = tl.load(cu_ptr + seq + 1) - first
    root_row = first + seq  # node i's row is root_row + 1 + i
    best_depth = tl.full((), 0, tl.int64)
    best_node = tl.full((), -1, tl.int64)  # -1: the root
    for start in range(0, num_nodes, BLOCK_N):
        node = start + tl.arange(0, BLOCK_N)
        # Walk every node up to the root: its depth, and whether each node on the way matches.
        accepted = node < num_nodes
        at = tl.where(accepted, node, -1)
        depth = tl.zeros([BLOCK_N], dtype=tl.int64)
        for _ in range(num_nodes):
            live = at >= 0
            parent = tl.load(parent_ptr + first + at, mask=live, other=-1).to(tl.int64)
            token = tl.load(draft_ptr + first + at, mask=live, other=0)
            target = tl.load(argmax_ptr + root_row + 1 + parent, mask=live, other=0)
            accepted = accepted & ((token == target) | (at < 0))
            depth += live.to(tl.int64)
            at = tl.where(live, parent, -1)
        depth = tl.where(accepted, depth, 0)
        chunk_depth = tl.max(depth, axis=0)
        chunk_node = tl.min(tl.where(accepted & (depth == chunk_depth), node, num_nodes), axis=0)
        deeper = chunk_depth > best_depth  # ties keep the earlier (lower) node
        best_node = tl.where(deeper, chunk_node, best_node)
        best_depth = tl.where(deeper, chunk_depth, best_depth)
    tl.store(num_accepted_ptr + seq, best_depth)
    tl.store(next_token_ptr + seq, tl.load(argmax_ptr + root_row + 1 + best_node))

    # Slot s holds the best node's ancestor at depth s + 1, then -1 past the path.
    for start in range(0, num_nodes, BLOCK_N):
        slot = start + tl.arange(0, BLOCK_N)
        steps_up = best_depth - 1 - slot  # [BLOCK_N]
        at = tl.zeros([BLOCK_N], dtype=tl.int64) + best_node
        for step in range(num_nodes):
            climb = steps_up > step
            at = tl.where(climb, tl.load(parent_ptr + first + at, mask=climb, other=-1).to(tl.int64), at)
        tl.store(accepted_nodes_ptr + first + slot, tl.where(steps_up >= 0, at, -1), mask=slot < num_nodes)


@triton.jit
def _tree_sample_kernel(draft_ptr, parent_ptr, cu_ptr, probs_ptr, uniform_ptr, uniform_final_ptr, num_accepted_ptr,
                        accepted_nodes_ptr, next_token_ptr, vocab, PROB_SCALE: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_V: tl.constexpr):
    seq = tl.program_id(0)
    first = tl.load(cu_ptr + seq)
    num_nodes = tl.load(cu_ptr + seq + 1) - first
    root_row = first + seq  # node i's row is root_row + 1 + i

    # The walk, in node order (a node's children all come after it), in float64 as the reference's:
    # a child of the newest accepted node is tried unless an earlier sibling with its token was rejected
    # (no mass is left for it); accepted with probability p(c) / the mass not yet rejected at its row.
    path_end = tl.full((), -1, tl.int64)  # the newest accepted node; -1: the root
    left = tl.full((), 1.0, tl.float64)
    accepted = tl.full((), 0, tl.int64)
    for node in range(num_nodes):
        parent = tl.load(parent_ptr + first + node).to(tl.int64)
        token = tl.load(draft_ptr + first + node)
        repeats = tl.full((), 0, tl.int32)
        for start in range(0, node, BLOCK_N):
            earlier = start + tl.arange(0, BLOCK_N)
            before = earlier < node
            sibling = tl.load(parent_ptr + first + earlier, mask=before, other=-2) == path_end
            same = tl.load(draft_ptr + first + earlier, mask=before, other=-1) == token
            repeats += tl.sum((sibling & same).to(tl.int32), axis=0)
        tried = (parent == path_end) & (repeats == 0)
        p = tl.load(probs_ptr + (root_row + 1 + parent) * vocab + token, mask=tried, other=0.0).to(tl.float64)
        uniform = tl.load(uniform_ptr + first + node, mask=tried, other=1.0).to(tl.float64)
        accept = tried & (uniform * left < p)
        tl.store(accepted_nodes_ptr + first + accepted, node, mask=accept)
        accepted += accept.to(tl.int64)
        path_end = tl.where(accept, node, path_end)
        left = tl.where(accept, 1.0, tl.where(tried, left - p, left))
    tl.store(num_accepted_ptr + seq, accepted)
    for start in range(0, num_nodes, BLOCK_N):
        slot = start + tl.arange(0, BLOCK_N)
        tl.store(accepted_nodes_ptr + first + slot, tl.full([BLOCK_N], -1, tl.int64),
                 mask=(slot >= accepted) & (slot < num_nodes))

    # The next token, from the path's last row with its rejected children's tokens (all of its
    # children's) at zero weight, or from that row as it is if nothing is left: as the reference's
    # fixed-point inverse CDF, in two passes (totals, then the block the draw falls in).
    p_row = probs_ptr + (root_row + 1 + path_end) * vocab
    p_total = tl.full((), 0, tl.int64)
    left_total = tl.full((), 0, tl.int64)
    for start in range(0, vocab, BLOCK_V):
        weights, left_weights = _final_weights(p_row, start, vocab, draft_ptr, parent_ptr, first, num_nodes,
                                               path_end, PROB_SCALE, BLOCK_N, BLOCK_V)
        p_total += tl.sum(weights, axis=0)
        left_total += tl.sum(left_weights, axis=0)
    use_left = left_total > 0
    total = tl.where(use_left, left_total, p_total)
    threshold = (tl.load(uniform_final_ptr + seq).to(tl.float64) * total.to(tl.float64)).to(tl.int64)
    token = tl.full((), 0, tl.int64) + vocab - 1  # stays only if every weight is 0, as the reference's clamp
    carry = tl.full((), 0, tl.int64)
    for start in range(0, vocab, BLOCK_V):
        weights, left_weights = _final_weights(p_row, start, vocab, draft_ptr, parent_ptr, first, num_nodes,
                                               path_end, PROB_SCALE, BLOCK_N, BLOCK_V)
        token, carry = draw_in_block(tl.where(use_left, left_weights, weights), start, carry, threshold, token)
    tl.store(next_token_ptr + seq, token)


@triton.jit
def _final_weights(p_row, start, vocab, draft_ptr, parent_ptr, first, num_nodes, path_end, PROB_SCALE: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """Fixed-point weights of p at tokens start .. start + BLOCK_V - 1 (0 past the vocabulary), and
    the same with the tokens of path_end's children at 0."""
    token = start + tl.arange(0, BLOCK_V)
    weights = (tl.load(p_row + token, mask=token < vocab, other=0.0) * PROB_SCALE).to(tl.int64)
    rejected = tl.zeros([BLOCK_V], dtype=tl.int32)
    for node_start in range(0, num_nodes, BLOCK_N):
        node = node_start + tl.arange(0, BLOCK_N)
        live = node < num_nodes
        child = tl.load(parent_ptr + first + node, mask=live, other=-2) == path_end
        child_token = tl.where(child, tl.load(draft_ptr + first + node, mask=live, other=-1), -1)
        rejected += tl.sum((token[:, None] == child_token[None, :]).to(tl.int32), axis=1)
    return weights, tl.where(rejected > 0, 0, weights)


@triton.jit
def _tree_attention_kernel(parent_ptr, cu_ptr, start_pos_ptr, mask_offsets_ptr, positions_ptr, mask_ptr,
                           BLOCK_ROWS: tl.constexpr, BLOCK_ENTRIES: tl.constexpr):
    seq = tl.program_id(0)
    first = tl.load(cu_ptr + seq)
    num_nodes = tl.load(cu_ptr + seq + 1) - first
    width = num_nodes + 1  # rows: the root (0), then node i at row 1 + i
    root_row = first + seq
    start_position = tl.load(start_pos_ptr + seq)

    # A row's position is the root's plus its depth: the steps from it up to the root.
    for start in range(0, width, BLOCK_ROWS):
        row = start + tl.arange(0, BLOCK_ROWS)
        at = tl.where(row < width, row, 0)
        depth = tl.zeros([BLOCK_ROWS], dtype=tl.int64)
        for _ in range(num_nodes):
            below_root = at > 0
            depth += below_root.to(tl.int64)
            parent_row = tl.load(parent_ptr + first + at - 1, mask=below_root, other=-1).to(tl.int64) + 1
            at = tl.where(below_root, parent_row, 0)
        tl.store(positions_ptr + root_row + row, start_position + depth, mask=row < width)

    # Entry [i, j] of the row-major block: is row j on the walk from row i up past the root?
    mask_start = tl.load(mask_offsets_ptr + seq)
    for start in range(0, width * width, BLOCK_ENTRIES):
        entry = start + tl.arange(0, BLOCK_ENTRIES)
        i = entry // width
        j = entry % width
        in_block = entry < width * width
        visible = i == j
        at = tl.where(in_block, i, -1)
        for _ in range(num_nodes):
            below_root = at > 0
            parent_row = tl.load(parent_ptr + first + at - 1, mask=below_root, other=-1).to(tl.int64) + 1
            at = tl.where(below_root, parent_row, -1)  # -1 once past the root
            visible = visible | (at == j)
        tl.store(mask_ptr + mask_start + entry, visible, mask=in_block)
