"""Paged attention for one forward: where new K/V go, and which cached keys each query sees.

Tokens of all sequences are flattened into one [T, ...] batch; a plan built
once per forward serves every layer. Queries go through
`kernels.paged_attention`, which reads the paged cache in place and gives each
query the same bits whatever else is in the batch. With the compiled CPU
kernel that includes prompts: it is faster than SDPA up to ~600-token prompts
and ~10% slower at 1024, and one kernel for every query gives a prompt the same
bits however its tokens are split across forwards. Elsewhere (the Triton
kernel: one program per query row; the reference) a prompt prefilled from its
first token attends through SDPA's causal kernel on the K/V just computed; a
prompt is then always prefilled that way, so outputs stay batch invariant.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

import kernels
from kernels.layout import ancestor_mask
from engine.kv_cache import KVCache
from engine.linear_cpu import MAX_SHARED_ROWS, shared_runs


@dataclass
class SeqSpan:
    """One sequence's share of a flattened batch."""
    start: int  # tokens already cached, in slots 0..start-1
    num_new: int  # new tokens, written to slots start..start+num_new-1
    blocks: list[int]  # block table covering start + num_new tokens
    # Attention structure of the new tokens: parents[i] is the new token that token i follows,
    # -1 the cached prefix. None: a chain, each new token following the one before it.
    parents: list[int] | None = None


class PagedAttention:
    """Per-forward plan: where the new tokens' K/V go; which spans are prefills; the block tables and
    masks every layer's paged-kernel call reads; which rows share a matmul call (matmul_rows)."""

    def __init__(self, spans: list[SeqSpan], write_slots: torch.Tensor, cache: KVCache):
        device = cache.device
        self.cache = cache
        self.write_slots = write_slots.to(device)  # [T]: where the new tokens' entries go, in batch order
        firsts = list(accumulate((s.num_new for s in spans), initial=0))  # each span's first row, then T
        self.num_tokens = firsts[-1]
        is_prefill = [s.start == 0 and is_chain(s) for s in spans]
        by_sdpa = is_prefill if kernels.attention_backend(device) != "cpu" else [False] * len(spans)
        self.prefill_rows = [slice(firsts[i], firsts[i + 1]) for i, p in enumerate(by_sdpa) if p]
        paged = [i for i, p in enumerate(by_sdpa) if not p]
        self.paged_rows = _rows([slice(firsts[i], firsts[i + 1]) for i in paged], device)
        self.matmul_rows = matmul_rows(firsts, is_prefill)
        paged_spans = [spans[i] for i in paged]
        if paged_spans:
            width = max(len(s.blocks) for s in paged_spans)
            # Padded with block 0: the kernel reads no position past a sequence's own tokens.
            self.block_tables = _int64([s.blocks + [0] * (width - len(s.blocks)) for s in paged_spans], device)
            self.query_start = _int64(list(accumulate((s.num_new for s in paged_spans), initial=0)), device)
            self.context_start = _int64([s.start for s in paged_spans], device)
            self.tree_offsets, self.tree_mask = tree_masks(paged_spans, device)
        self._new_keys = self._new_values = None

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, KV, Dh] into the new tokens' slots (and kept for this layer's prefills)."""
        kernels.write_kv(self.cache.keys[layer], self.cache.values[layer], k, v, self.write_slots)
        self._new_keys, self._new_values = k, v

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [T, H, Dh] (rows may be strided) -> attention output [T, H * Dh]; after this layer's write."""
        if not self.prefill_rows:
            return self._attend_paged(layer, q).view(self.num_tokens, -1)
        out = q.new_empty(self.num_tokens, q.shape[1], q.shape[2])
        for rows in self.prefill_rows:
            out[rows] = self._attend_prefill(q[rows], self._new_keys[rows], self._new_values[rows])
        if self.paged_rows is not None:
            out[self.paged_rows] = self._attend_paged(layer, q[self.paged_rows])
        return out.view(self.num_tokens, -1)

    def _attend_paged(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        return kernels.paged_attention(q, self.cache.keys[layer], self.cache.values[layer], self.block_tables,
                                       self.query_start, self.context_start, self.tree_mask, self.tree_offsets,
                                       self.cache.block_size, q.shape[-1] ** -0.5)

    @staticmethod
    def _attend_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One prompt from its first token: q [n, H, Dh], k, v [n, KV, Dh] -> [n, H, Dh]."""
        # With a batch dimension: 3-D inputs miss SDPA's flash kernel on CPU (10x slower, measured).
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], is_causal=True, enable_gqa=True)  # [1, H, n, Dh]
        return out[0].transpose(0, 1)


def matmul_rows(firsts: list[int], is_prefill: list[bool]) -> list[slice]:
    """The row slices that each go through the matmuls as one call, covering the batch in order. Up to
    MAX_SHARED_ROWS rows the engine checks that a matmul's rows do not depend on the row count, so the
    rows go in runs of at most that many, except a prompt prefilled from its first token with more
    rows than that: it goes on its own, so that its rows meet the same kernel whatever else is in the
    batch. `firsts`: each span's first row, then the row count."""
    rows: list[slice] = []
    shared_from = 0  # first row of the current run
    for i, prefill in enumerate(is_prefill):
        if prefill and firsts[i + 1] - firsts[i] > MAX_SHARED_ROWS:
            rows += shared_runs(shared_from, firsts[i]) + [slice(firsts[i], firsts[i + 1])]
            shared_from = firsts[i + 1]
    return rows + shared_runs(shared_from, firsts[-1])


def tree_masks(spans: list[SeqSpan], device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """tree_offsets [B] (-1: a chain) and the flattened ancestor-or-self masks of the tree spans (or None).

    A span whose parents form a chain is passed as one: the kernel needs no mask for it.
    """
    offsets, masks, offset = [], [], 0
    for span in spans:
        if is_chain(span):
            offsets.append(-1)
            continue
        masks.append(ancestor_mask(span.parents).flatten())
        offsets.append(offset)
        offset += span.num_new ** 2
    return _int64(offsets, device), torch.cat(masks).to(device) if masks else None


def is_chain(span: SeqSpan) -> bool:
    """Each new token follows the one before it; the first follows the cached prefix (parent -1)."""
    return span.parents is None or span.parents == list(range(-1, span.num_new - 1))


def _rows(ranges: list[slice], device) -> slice | torch.Tensor | None:
    """The batch rows of `ranges` as one slice where they are consecutive (no copy), else an index."""
    if not ranges:
        return None
    if all(a.stop == b.start for a, b in zip(ranges, ranges[1:])):
        return slice(ranges[0].start, ranges[-1].stop)
    return torch.cat([torch.arange(r.start, r.stop) for r in ranges]).to(device)


def _int64(values: list, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
