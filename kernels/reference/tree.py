"""Tree drafts in plain PyTorch: greedy and sampled tree acceptance, tree attention mask and positions.

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
from kernels.reference.chain import draw_residual


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
    seq_of_node, _ = _check_parents(parent_ids, cu_draft_lens)
    row_start = target_row_offsets(cu_draft_lens)
    matches = (draft_token_ids == target_argmax[row_start[seq_of_node] + 1 + parent_ids]).tolist()  # [N]
    parents, cu, starts = parent_ids.tolist(), cu_draft_lens.tolist(), row_start.tolist()
    num_accepted, accepted_nodes, last_rows = [0] * (len(cu) - 1), [-1] * len(parents), []
    for b in range(len(cu) - 1):  # one pass per tree: parents come before their children
        first, deepest = cu[b], -1
        depth = [0] * (cu[b + 1] - first)  # of each accepted node; 0: not accepted
        for node in range(len(depth)):
            parent = parents[first + node]
            if matches[first + node] and (parent < 0 or depth[parent]):
                depth[node] = 1 + (depth[parent] if parent >= 0 else 0)
                if depth[node] > num_accepted[b]:
                    num_accepted[b], deepest = depth[node], node
        node = deepest
        while node >= 0:
            accepted_nodes[first + depth[node] - 1] = node
            node = parents[first + node]
        last_rows.append(starts[b] + 1 + deepest)
    next_token = target_argmax[torch.tensor(last_rows, dtype=torch.long, device=target_argmax.device)]
    return _long(num_accepted, cu_draft_lens), _long(accepted_nodes, cu_draft_lens), next_token


def tree_rejection_sample(draft_token_ids: torch.Tensor, parent_ids: torch.Tensor, cu_draft_lens: torch.Tensor,
                          target_probs: torch.Tensor, uniform_accept: torch.Tensor,
                          uniform_final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling of deterministic draft trees (SpecInfer; EAGLE's evaluate_posterior).

    target_probs [N+B, V] float32: the target distribution at every row, after all logits processors;
    uniform_accept [N], uniform_final [B]: U(0,1) draws from each sequence's own generator. From the
    root, the children of the newest accepted node are tried in index order: child c is accepted when
    uniform_accept[c] < p'(c), p' being the distribution at its parent's row with the children already
    rejected there set to zero and the rest renormalised; then its own children are tried. The token
    after the accepted path is drawn (inverse CDF, uniform_final) from p' at the path's last row: the
    recovered token after a rejection, the bonus token otherwise. A chain gets exactly what
    `rejection_sample` gives it from the same draws. Returns (num_accepted [B], accepted_nodes [N],
    next_token [B]) as `tree_greedy_accept`.
    """
    seq_of_node, _ = _check_parents(parent_ids, cu_draft_lens)
    row_start = target_row_offsets(cu_draft_lens)
    p_node = target_probs[row_start[seq_of_node] + 1 + parent_ids, draft_token_ids].tolist()  # at the parent's row
    tokens, parents, uniform = draft_token_ids.tolist(), parent_ids.tolist(), uniform_accept.tolist()
    cu, starts = cu_draft_lens.tolist(), row_start.tolist()
    num_accepted, accepted_nodes = [0] * (len(cu) - 1), [-1] * len(tokens)
    final_rows, zeroed_seqs, zeroed_tokens = [], [], []
    for b in range(len(cu) - 1):
        path_end, left, rejected = -1, 1.0, set()  # the newest accepted node, the mass not rejected at its row
        for node in range(cu[b], cu[b + 1]):  # a node's children all come after it, in order
            if parents[node] != path_end or tokens[node] in rejected:  # (a repeated token has no mass left)
                continue
            if uniform[node] * left < p_node[node]:
                path_end, left, rejected = node - cu[b], 1.0, set()
                accepted_nodes[cu[b] + num_accepted[b]] = path_end
                num_accepted[b] += 1
            else:
                left -= p_node[node]
                rejected.add(tokens[node])
        final_rows.append(starts[b] + 1 + path_end)
        zeroed_seqs += [b] * len(rejected)
        zeroed_tokens += sorted(rejected)
    device = cu_draft_lens.device
    rows = torch.tensor(final_rows, dtype=torch.long, device=device)
    probs = target_probs[rows]  # [B, V], a copy
    probs[torch.tensor(zeroed_seqs, dtype=torch.long, device=device),
          torch.tensor(zeroed_tokens, dtype=torch.long, device=device)] = 0.0
    return _long(num_accepted, cu_draft_lens), _long(accepted_nodes, cu_draft_lens), \
        draw_residual(probs, target_probs, rows, uniform_final)


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


def _long(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)
