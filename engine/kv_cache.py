"""Paged KV cache: fixed-size blocks shared by all sequences.

The allocator only does bookkeeping (a free list, one block table per
sequence); `KVCache` holds the per-layer K/V pools the slots index into.
"""
from __future__ import annotations

import torch

import kernels
from engine.config import EngineConfig


class OutOfBlocks(Exception):
    """Not enough free KV blocks for a reservation."""


class BlockAllocator:
    """Paged KV bookkeeping: fixed-size blocks, a free list, a block table per sequence."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A stack popped from the end, so a fresh allocator hands out 0, 1, 2, ...
        self._free = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def has(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def capacity(self, seq_id: str) -> int:
        """Tokens the sequence's blocks can hold."""
        return len(self._tables.get(seq_id, ())) * self.block_size

    def blocks_needed(self, seq_id: str, length: int) -> int:
        """New blocks `reserve(seq_id, length)` would allocate."""
        have = len(self._tables.get(seq_id, ()))
        return max(0, self._num_blocks_for(length) - have)

    def can_reserve(self, seq_id: str, length: int) -> bool:
        return self.blocks_needed(seq_id, length) <= len(self._free)

    def reserve(self, seq_id: str, length: int) -> None:
        """Ensure capacity for `length` total tokens; all or nothing."""
        needed = self.blocks_needed(seq_id, length)
        if needed > len(self._free):
            raise OutOfBlocks(f"{seq_id!r} needs {needed} blocks, {len(self._free)} free")
        table = self._tables.setdefault(seq_id, [])
        for _ in range(needed):
            table.append(self._free.pop())

    def truncate(self, seq_id: str, length: int) -> None:
        """Roll back: keep capacity for only `length` tokens, free whole blocks past it."""
        table = self._tables.get(seq_id)
        if table is None:
            return
        keep = self._num_blocks_for(length)
        while len(table) > keep:
            self._free.append(table.pop())

    def free(self, seq_id: str) -> None:
        # Reversed, so the table's first block is the next one handed out again.
        self._free.extend(reversed(self._tables.pop(seq_id, ())))

    def block_table(self, seq_id: str) -> list[int]:
        return list(self._tables.get(seq_id, ()))

    def slots(self, seq_id: str, start: int, end: int) -> torch.Tensor:
        """Flat slot indices (block * block_size + offset) for positions [start, end)."""
        if not 0 <= start <= end <= self.capacity(seq_id):
            raise IndexError(f"positions [{start}, {end}) outside the {self.capacity(seq_id)} "
                             f"reserved for {seq_id!r}")
        positions = torch.arange(start, end, dtype=torch.int64)  # [n]
        table = torch.tensor(self._tables.get(seq_id, []), dtype=torch.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def _num_blocks_for(self, length: int) -> int:
        return -(-max(length, 0) // self.block_size)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of every layer: in bf16 the same memory holds twice the tokens of fp32."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


class KVCache:
    """Per-layer K and V pools in the layout the device's attention kernel reads: packed by block on CPU
    (kernels.layout), else [num_blocks * block_size, num_kv_heads, head_dim]. Entries are addressed by
    slot = block * block_size + offset either way (kernels.read_slots / write_slots)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int, engine: EngineConfig = EngineConfig()):
        self.block_size = block_size
        self.dtype, self.device = engine.dtype, torch.device(engine.device)
        self.num_tokens = num_blocks * block_size
        self.bytes_per_token = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, self.dtype)
        key_shape = value_shape = (num_blocks * block_size, num_kv_heads, head_dim)
        if kernels.packs_caches(self.device):
            key_shape = kernels.packed_key_shape(num_blocks, block_size, num_kv_heads, head_dim, self.dtype)
            value_shape = kernels.packed_value_shape(num_blocks, block_size, num_kv_heads, head_dim, self.dtype)
        self.keys = [torch.zeros(key_shape, dtype=self.dtype, device=self.device) for _ in range(num_layers)]
        self.values = [torch.zeros(value_shape, dtype=self.dtype, device=self.device) for _ in range(num_layers)]
