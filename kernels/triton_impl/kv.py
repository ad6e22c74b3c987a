"""KV compaction in Triton: every layer's K and V pools in two launches.

Same signature and effect as `kernels.reference.kv.compact_kv`. The first launch
copies the source entries of every pool to a staging buffer, the second writes
them to their destinations: the launch boundary makes every read happen before
any write, so sources may overlap destinations.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

_BLOCK_MOVES = 16  # entries moved per program
_MAX_BLOCK_WIDTH = 256  # elements of an entry (kv_heads * head_dim) per step


def compact_kv(pools: Sequence[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    num_moves = src_slots.numel()
    if not pools or not num_moves:
        return
    _check_alike(pools)
    width = pools[0][0].numel()  # kv_heads * head_dim
    # One launch reaches every pool through a table of their addresses.
    pool_ptrs = torch.tensor([pool.data_ptr() for pool in pools], dtype=torch.int64, device=src_slots.device)
    staged = torch.empty(len(pools), num_moves, width, dtype=pools[0].dtype, device=pools[0].device)
    grid = (len(pools), triton.cdiv(num_moves, _BLOCK_MOVES))
    block_width = min(triton.next_power_of_2(width), _MAX_BLOCK_WIDTH)
    for slots, to_pools in ((src_slots, False), (dst_slots, True)):
        _move_entries_kernel[grid](pool_ptrs, slots, staged, num_moves, width, TO_POOLS=to_pools,
                                   BLOCK_M=_BLOCK_MOVES, BLOCK_W=block_width)


def _check_alike(pools: Sequence[torch.Tensor]) -> None:
    first = pools[0]
    for pool in pools:
        if pool.shape != first.shape or pool.dtype != first.dtype or pool.device != first.device:
            raise ValueError("every KV pool must have the same shape, dtype and device")
        if not pool.is_contiguous():
            raise ValueError("KV pools must be contiguous")


@triton.jit
def _move_entries_kernel(pool_ptrs, slots_ptr, staged_ptr, num_moves, width, TO_POOLS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr):
    """Copies pool entries at slots to the staging buffer [pools, moves, width], or back when TO_POOLS."""
    pool = tl.program_id(0)
    move = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    is_move = move < num_moves
    pool_base = tl.load(pool_ptrs + pool).to(tl.pointer_type(staged_ptr.dtype.element_ty))
    slot = tl.load(slots_ptr + move, mask=is_move, other=0)
    pool_entries = pool_base + slot[:, None] * width  # [BLOCK_M, 1]
    staged_entries = staged_ptr + (pool * num_moves + move)[:, None] * width
    for start in range(0, width, BLOCK_W):
        col = start + tl.arange(0, BLOCK_W)
        in_entry = is_move[:, None] & (col < width)[None, :]  # [BLOCK_M, BLOCK_W]
        if TO_POOLS:
            tl.store(pool_entries + col[None, :], tl.load(staged_entries + col[None, :], mask=in_entry),
                     mask=in_entry)
        else:
            tl.store(staged_entries + col[None, :], tl.load(pool_entries + col[None, :], mask=in_entry),
                     mask=in_entry)
