"""Tree drafts in plain PyTorch: greedy tree acceptance, tree attention mask and positions.

Sequence b's tree is draft nodes cu_draft_lens[b] .. cu_draft_lens[b+1] - 1,
each with parent_ids = the local index of its parent node, or -1 when its parent
is the root (the sequence's last committed token). Parents precede children.
Target rows follow `kernels.layout`: row 0 of a sequence is the root, row 1 + i
is node i, so the target's choice at a node's row scores that node's children.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from kernels.layout import draft_layout, segment_ids, target_row_offsets, tree_mask_offsets


def tree_greedy_accept(draft_token_ids: torch.Tensor, parent_ids: torch.Tensor, cu_draft_lens: torch.Tensor,
                       target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy verification of draft trees.

    draft_token_ids, parent_ids [N], cu_draft_lens [B+1], target_argmax [N+B].
    A node is accepted when it and each of its ancestors equal the target's
    argmax at their parent's row. Returns
      num_accepted [B]: depth of the deepest accepted node (0: none);
      accepted_nodes [N]: sequence b's slots cu_draft_lens[b] .. hold that node's
        path from the root's child down (local node indices), then -1;
      next_token [B]: the target's argmax at that node's row (the bonus token).
    Among equally deep accepted nodes the lowest index wins.
    """
    seq_of_node, local = _check_parents(parent_ids, cu_draft_lens)
    first = cu_draft_lens[:-1]  # [B] each sequence's first node
    row_start = target_row_offsets(cu_draft_lens)[:-1]  # [B]
    parent = torch.where(parent_ids >= 0, first[seq_of_node] + parent_ids, -1)  # [N] global node index
    matches = draft_token_ids == target_argmax[row_start[seq_of_node] + 1 + parent_ids]  # [N]
    depth, accepted = _depth_and_acceptance(matches, parent)
    num_accepted, deepest = _deepest_accepted(depth, accepted, seq_of_node, local, first.numel())
    next_token = target_argmax[row_start + 1 + deepest]
    return num_accepted, _path_slots(deepest, first, parent, depth), next_token


def build_tree_attention(parent_ids: torch.Tensor, cu_draft_lens: torch.Tensor,
                         start_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and attention mask of a batch of draft trees' target rows.

    parent_ids [N], cu_draft_lens [B+1], start_positions [B] (the root's position:
    tokens already cached). Returns
      positions [N+B]: start_positions + depth (the root has depth 0);
      tree_mask [sum((n_b+1)^2)] bool: sequence b's (n_b+1) x (n_b+1) block,
        row-major at tree_mask_offsets(cu_draft_lens)[b]; entry [i, j] is True
        iff row j is an ancestor-or-self of row i. The cached prefix, visible
        to every row, is not part of the mask.
    """
    _check_parents(parent_ids, cu_draft_lens)
    parent_row = _parent_rows(parent_ids, cu_draft_lens)  # [N+B]
    seq_of_row = segment_ids(target_row_offsets(cu_draft_lens))  # [N+B]
    depth = sum(node >= 0 for node in _ancestors_or_self(parent_row, parent_row))
    positions = start_positions[seq_of_row] + depth
    return positions, _ancestor_mask(parent_row, cu_draft_lens)


def _check_parents(parent_ids: torch.Tensor, cu_draft_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N] each node's sequence and local index, once every parent is known to precede its child."""
    seq_of_node, local = draft_layout(cu_draft_lens)
    if not bool(((parent_ids >= -1) & (parent_ids < local)).all()):
        raise ValueError("every parent_ids entry must be -1 or the index of an earlier node of its tree")
    return seq_of_node, local


def _ancestors_or_self(nodes: torch.Tensor, parent: torch.Tensor) -> Iterator[torch.Tensor]:
    """Yields nodes, their parents, grandparents, ... (-1 past a root) until every walk has ended."""
    while bool((nodes >= 0).any()):
        yield nodes
        nodes = torch.where(nodes >= 0, parent[nodes.clamp_min(0)], -1)


def _depth_and_acceptance(matches: torch.Tensor, parent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N] each node's depth, and whether it and every ancestor match the target."""
    depth = torch.zeros_like(parent)
    accepted = torch.ones_like(matches)
    for node in _ancestors_or_self(torch.arange(parent.numel(), device=parent.device), parent):
        live = node >= 0
        depth += live
        accepted &= ~live | matches[node.clamp_min(0)]
    return depth, accepted


def _deepest_accepted(depth: torch.Tensor, accepted: torch.Tensor, seq_of_node: torch.Tensor, local: torch.Tensor,
                      num_seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B] depth and local index of each sequence's deepest accepted node (0 and -1 when none)."""
    none = depth.numel()  # beyond every node index
    num_accepted = depth.new_zeros(num_seqs).scatter_reduce(0, seq_of_node, torch.where(accepted, depth, 0),
                                                            reduce="amax")
    is_deepest = accepted & (depth == num_accepted[seq_of_node])
    deepest = depth.new_full((num_seqs,), none).scatter_reduce(0, seq_of_node, torch.where(is_deepest, local, none),
                                                               reduce="amin")  # ties: the lowest index
    return num_accepted, torch.where(num_accepted > 0, deepest, -1)


def _parent_rows(parent_ids: torch.Tensor, cu_draft_lens: torch.Tensor) -> torch.Tensor:
    """[N+B] the global row of each row's parent; -1 for the roots."""
    seq_of_node, local = draft_layout(cu_draft_lens)
    row_start = target_row_offsets(cu_draft_lens)
    parent_row = torch.full((int(row_start[-1]),), -1, dtype=parent_ids.dtype, device=parent_ids.device)
    parent_row[row_start[seq_of_node] + 1 + local] = row_start[seq_of_node] + 1 + parent_ids
    return parent_row


def _ancestor_mask(parent_row: torch.Tensor, cu_draft_lens: torch.Tensor) -> torch.Tensor:
    """[sum((n+1)^2)] bool: per sequence, [i, j] = row j is an ancestor-or-self of row i."""
    offsets = tree_mask_offsets(cu_draft_lens)
    width = cu_draft_lens[1:] - cu_draft_lens[:-1] + 1  # [B]
    seq = segment_ids(offsets)  # [M]
    entry = torch.arange(seq.numel(), device=seq.device) - offsets[seq]
    row_start = target_row_offsets(cu_draft_lens)[seq]
    row_i, row_j = row_start + entry // width[seq], row_start + entry % width[seq]
    mask = torch.zeros_like(row_i, dtype=torch.bool)
    for ancestor in _ancestors_or_self(row_i, parent_row):
        mask |= ancestor == row_j
    return mask


def _path_slots(deepest: torch.Tensor, first: torch.Tensor, parent: torch.Tensor,
                depth: torch.Tensor) -> torch.Tensor:
    """[N] the path to each sequence's deepest node (local indices, by depth) in its slots, then -1."""
    accepted_nodes = torch.full_like(parent, -1)
    path_node = torch.where(deepest >= 0, first + deepest, -1)  # [B] global
    for node in _ancestors_or_self(path_node, parent):
        on_path = node >= 0
        path_step, start = node[on_path], first[on_path]
        accepted_nodes[start + depth[path_step] - 1] = path_step - start
    return accepted_nodes
