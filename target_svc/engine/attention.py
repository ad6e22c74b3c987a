"""Paged attention for one forward: where new K/V go, and which cached keys each query sees.

Tokens of all sequences are flattened into one [T, ...] batch; a plan built
once per forward serves every layer. The attention itself is a kernel
(`kernels.paged_attention`) that reads the paged cache in place.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

import kernels
from kernels.layout import ancestor_mask
from target_svc.engine.kv_cache import KVCache


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
    """Per-forward plan: the new tokens' cache slots, and the block tables and masks every layer's kernel call reads."""

    def __init__(self, spans: list[SeqSpan], write_slots: torch.Tensor, cache: KVCache):
        device = cache.device
        self.cache = cache
        self.write_slots = write_slots.to(device)  # [T] cache slot of every new token, in batch order
        width = max(len(s.blocks) for s in spans)
        # Padded with block 0: the kernel reads no position past a sequence's own tokens.
        self.block_tables = _int64([s.blocks + [0] * (width - len(s.blocks)) for s in spans], device)  # [B, W]
        self.query_start = _int64(list(accumulate((s.num_new for s in spans), initial=0)), device)  # [B+1]
        self.context_start = _int64([s.start for s in spans], device)  # [B]
        self.tree_offsets, self.tree_mask = tree_masks(spans, device)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, KV, Dh] into the new tokens' slots."""
        self.cache.keys[layer].index_copy_(0, self.write_slots, k)
        self.cache.values[layer].index_copy_(0, self.write_slots, v)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [T, H, Dh] (rows may be strided) -> attention output [T, H * Dh]."""
        out = kernels.paged_attention(q, self.cache.keys[layer], self.cache.values[layer], self.block_tables,
                                      self.query_start, self.context_start, self.tree_mask, self.tree_offsets,
                                      self.cache.block_size, q.shape[-1] ** -0.5)
        return out.view(q.shape[0], -1)


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


def _int64(values: list, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
