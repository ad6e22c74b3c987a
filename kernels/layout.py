"""Index arithmetic of the flattened verification batch, shared by every implementation.

Sequence b owns draft nodes `cu_draft_lens[b] .. cu_draft_lens[b+1] - 1` and
target rows `row_start[b] .. row_start[b+1] - 1` with row_start = cu_draft_lens + b:
row 0 of a sequence holds its last committed token (the root), row 1 + i draft
node i. A chain is the tree whose node i has parent i - 1.
"""
from __future__ import annotations

import torch


def target_row_offsets(cu_draft_lens: torch.Tensor) -> torch.Tensor:
    """[B+1] start of each sequence's target rows: drafts plus one bonus row each."""
    return cu_draft_lens + torch.arange(cu_draft_lens.numel(), device=cu_draft_lens.device)


def tree_mask_offsets(cu_draft_lens: torch.Tensor) -> torch.Tensor:
    """[B+1] start of each sequence's (n+1) x (n+1) block in a flattened tree mask."""
    rows = cu_draft_lens[1:] - cu_draft_lens[:-1] + 1  # [B]
    return torch.cat([cu_draft_lens.new_zeros(1), (rows * rows).cumsum(0)])


def draft_layout(cu_draft_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N] each draft node's sequence and its index within that sequence."""
    seq_of_draft = segment_ids(cu_draft_lens)  # [N]
    pos_in_draft = torch.arange(seq_of_draft.numel(), device=seq_of_draft.device) - cu_draft_lens[seq_of_draft]
    return seq_of_draft, pos_in_draft


def segment_ids(offsets: torch.Tensor) -> torch.Tensor:
    """[offsets[-1]] the segment of each element, for segments starting at offsets [S+1]."""
    elements = torch.arange(int(offsets[-1]), device=offsets.device)
    return torch.searchsorted(offsets[1:], elements, right=True)


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] bool for one token tree: entry [i, j] is True iff node j is node i or one of its ancestors.

    parents[i] is node i's parent, -1 for the root's children (the cached prefix); parents precede children.
    """
    mask = torch.eye(len(parents), dtype=torch.bool)
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"parents[{i}] = {parent}: a parent is -1 (the cached prefix) or an earlier node")
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask
