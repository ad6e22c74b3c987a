"""Paged KV cache: fixed-size blocks shared by all sequences.

The allocator only does bookkeeping (which blocks are free, one block table
per sequence); `KVCache` holds the per-layer K/V pools the slots index into.
"""
from __future__ import annotations

import math
import re

import torch


class OutOfBlocks(Exception):
    """Not enough free KV blocks for a reservation."""


_FREE_RUN = re.compile(b"\x01+")  # a run of free blocks in the allocator's flags


class BlockAllocator:
    """Paged KV bookkeeping: fixed-size blocks, free-block flags, a block table per sequence.

    Blocks are placed so that tables tend to stay contiguous, because attention
    reads a contiguous table in place instead of gathering it: a sequence grows
    into the blocks right after its tail while they are free, and otherwise
    starts a new run inside the largest free run.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._is_free = bytearray(b"\x01") * num_blocks  # one flag per block
        self._num_free = num_blocks
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

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
        return self.blocks_needed(seq_id, length) <= self._num_free

    def reserve(self, seq_id: str, length: int) -> None:
        """Ensure capacity for `length` total tokens; all or nothing."""
        needed = self.blocks_needed(seq_id, length)
        if needed > self._num_free:
            raise OutOfBlocks(f"{seq_id!r} needs {needed} blocks, {self._num_free} free")
        table = self._tables.setdefault(seq_id, [])
        while needed:
            start, count = self._next_run(table, needed)
            for block in range(start, start + count):
                self._take(block)
            table.extend(range(start, start + count))
            needed -= count

    def truncate(self, seq_id: str, length: int) -> None:
        """Roll back: keep capacity for only `length` tokens, free whole blocks past it."""
        table = self._tables.get(seq_id)
        if table is None:
            return
        keep = self._num_blocks_for(length)
        while len(table) > keep:
            self._release(table.pop())

    def free(self, seq_id: str) -> None:
        for block in self._tables.pop(seq_id, ()):
            self._release(block)

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

    def _next_run(self, table: list[int], needed: int) -> tuple[int, int]:
        """Where the next blocks go: (first block, how many), all free and consecutive."""
        after = table[-1] + 1 if table else self.num_blocks
        if after < self.num_blocks and self._is_free[after]:
            start, end = _FREE_RUN.match(self._is_free, after).span()
        else:
            start, end = self._new_run(needed)
        return start, min(needed, end - start)

    def _new_run(self, needed: int) -> tuple[int, int]:
        """The largest free run, its start moved on by half the room `needed` leaves spare,
        so that whatever precedes it can grow as well."""
        start, end = max((m.span() for m in _FREE_RUN.finditer(self._is_free)), key=lambda r: r[1] - r[0])
        spare = end - start - needed
        if start == 0 or spare <= 0:
            return start, end
        return start + spare // 2, end

    def _take(self, block: int) -> None:
        self._is_free[block] = 0
        self._num_free -= 1

    def _release(self, block: int) -> None:
        self._is_free[block] = 1
        self._num_free += 1

    def _num_blocks_for(self, length: int) -> int:
        return -(-max(length, 0) // self.block_size)


class KVCache:
    """Per-layer K and V pools of shape [num_blocks * block_size, num_kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype = torch.float32, device="cpu"):
        self.block_size = block_size
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # Reused across layers and steps: fresh multi-MB tensors every layer cost page faults.
        self._gather_k = torch.empty(0, dtype=dtype, device=device)
        self._gather_v = torch.empty(0, dtype=dtype, device=device)

    def gather_buffers(self, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Scratch K and V tensors [num_slots, KV, Dh] to gather cached keys into; valid until the next call."""
        shape = (num_slots, *self.keys[0].shape[1:])
        numel = math.prod(shape)
        if self._gather_k.numel() < numel:
            self._gather_k = torch.empty(numel, dtype=self._gather_k.dtype, device=self._gather_k.device)
            self._gather_v = torch.empty_like(self._gather_k)
        return self._gather_k[:numel].view(shape), self._gather_v[:numel].view(shape)
