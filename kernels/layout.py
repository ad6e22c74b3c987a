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


# On CPU the caches are packed by block, P = 4 // element size elements to a 32-bit lane (2 in bf16/fp16,
# 1 in fp32), as AVX512-BF16 dot products and AMX tiles read them (vLLM's CPU kernels call it VNNI):
#   keys   [num_blocks, KV, Dh / P, block_size, P]: dimension-major, P dims of a position side by side,
#          so the next P dims of 16 positions are one 64-byte load;
#   values [num_blocks, KV, block_size / P, Dh * P]: position-major, each dim of P consecutive positions
#          side by side, so 16 dims of P positions are one 64-byte load.
# The Triton kernels read [slots, KV, Dh] for both. Any way, an entry is addressed by its slot =
# block * block_size + offset; the pools tell their layout by their rank (5: keys, 4: values, 3: plain).

def pack_of(dtype: torch.dtype) -> int:
    """P: elements of a packed cache per 32-bit lane (1 for fp32, 2 for 16-bit types)."""
    return max(1, 4 // dtype.itemsize)


def packed_key_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype) -> tuple[int, ...]:
    pack = pack_of(dtype)
    if head_dim % pack:
        raise ValueError(f"head_dim {head_dim} is not a multiple of {pack}, the {dtype} pack")
    return num_blocks, num_kv_heads, head_dim // pack, block_size, pack


def packed_value_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> tuple[int, ...]:
    pack = pack_of(dtype)
    if block_size % pack:
        raise ValueError(f"block_size {block_size} is not a multiple of {pack}, the {dtype} pack")
    return num_blocks, num_kv_heads, block_size // pack, head_dim * pack


def pack_keys(keys: torch.Tensor, block_size: int) -> torch.Tensor:
    """[slots, KV, Dh] -> the packed key layout of the same entries (a copy)."""
    return _packed(keys, block_size, packed_key_shape)


def pack_values(values: torch.Tensor, block_size: int) -> torch.Tensor:
    """[slots, KV, Dh] -> the packed value layout of the same entries (a copy)."""
    return _packed(values, block_size, packed_value_shape)


def _packed(entries: torch.Tensor, block_size: int, shape_of) -> torch.Tensor:
    num_slots, kv_heads, head_dim = entries.shape
    packed = entries.new_empty(shape_of(num_slots // block_size, block_size, kv_heads, head_dim, entries.dtype))
    write_slots(packed, torch.arange(num_slots, device=entries.device), entries)
    return packed


def read_slots(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The entries of a K or V pool (packed or [slots, KV, Dh]) at `slots` [n], as [n, KV, Dh] (a copy)."""
    return pool.view(-1)[slot_elements(pool, slots)].view(slots.numel(), *_entry_shape(pool))


def write_slots(pool: torch.Tensor, slots: torch.Tensor, entries: torch.Tensor) -> None:
    """entries [n, KV, Dh] into a K or V pool (packed or [slots, KV, Dh]) at `slots` [n], in place."""
    if pool.dim() == 3:
        pool.index_copy_(0, slots, entries)
    else:
        pool.view(-1).index_copy_(0, slot_elements(pool, slots), entries.reshape(-1))


def slot_elements(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[n * KV * Dh] where the entries at `slots` sit in the flattened pool, in [n, KV, Dh] order."""
    kv_heads, head_dim = _entry_shape(pool)
    heads = torch.arange(kv_heads, device=slots.device)[None, :, None]
    dims = torch.arange(head_dim, device=slots.device)[None, None, :]
    slots = slots[:, None, None]
    if pool.dim() == 3:
        return ((slots * kv_heads + heads) * head_dim + dims).flatten()
    pack = pack_of(pool.dtype)
    if pool.dim() == 5:  # keys
        block_size = pool.shape[3]
        blocks, offsets = slots // block_size, slots % block_size
        groups = head_dim // pack
        return ((((blocks * kv_heads + heads) * groups + dims // pack) * block_size + offsets) * pack
                + dims % pack).flatten()
    block_size = pool.shape[2] * pack  # values
    blocks, offsets = slots // block_size, slots % block_size
    return ((((blocks * kv_heads + heads) * (block_size // pack) + offsets // pack) * head_dim + dims) * pack
            + offsets % pack).flatten()


def _entry_shape(pool: torch.Tensor) -> tuple[int, int]:
    """(KV, Dh) of a pool in any of the layouts."""
    if pool.dim() == 5:
        return pool.shape[1], pool.shape[2] * pool.shape[4]
    if pool.dim() == 4:
        return pool.shape[1], pool.shape[3] // pack_of(pool.dtype)
    return pool.shape[1], pool.shape[2]
