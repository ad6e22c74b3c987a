"""KV compaction in plain PyTorch."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.layout import read_slots, write_slots


def write_kv(key_pool: torch.Tensor, value_pool: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             slots: torch.Tensor) -> None:
    """New entries into one layer's pools (any layout, kernels.layout): keys, values [T, KV, Dh] at
    slots [T], in place."""
    write_slots(key_pool, slots, keys)
    write_slots(value_pool, slots, values)


def compact_kv(pools: Sequence[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """In every pool ([num_slots, kv_heads, head_dim], or packed: kernels.layout), moves entry
    src_slots[i] to dst_slots[i] ([M] each).

    In place, and as if every entry were read before any is written, so a source
    may also be a destination (an accepted path moving down over rejected nodes).
    dst_slots must be distinct. Pass every layer's K and V pools at once.
    """
    for pool in pools:
        write_slots(pool, dst_slots, read_slots(pool, src_slots))
