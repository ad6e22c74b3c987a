"""Paged attention in plain PyTorch: the specification of the attention kernels.

Every query reads its sequence's K/V from the paged cache through the block
table. Sequence b's new tokens are query rows query_start[b] .. query_start[b+1]-1;
their K/V already sit at positions context_start[b] + i of the sequence. What a
new token i sees: the cached prefix (positions < context_start[b]) and then
  - a chain (tree_offsets[b] == -1): the new tokens 0 .. i;
  - a tree: the new tokens j with tree_mask[tree_offsets[b] + i * n + j] (its
    ancestors and itself, n = the sequence's new tokens).
"""
from __future__ import annotations

import torch

from kernels.layout import read_slots


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start: torch.Tensor, context_start: torch.Tensor,
                    tree_mask: torch.Tensor | None, tree_offsets: torch.Tensor, block_size: int,
                    scale: float) -> torch.Tensor:
    """query [T, H, Dh]; key_cache and value_cache [slots, KV, Dh] (slot = block * block_size + offset), or
    both packed (kernels.layout); block_tables [B, W]; query_start [B+1]; context_start, tree_offsets [B];
    tree_mask [M] bool or None.
    Returns [T, H, Dh] in query's dtype, computed in fp32."""
    out = torch.empty_like(query)
    group = query.shape[1] // value_cache.shape[1]
    for b in range(context_start.numel()):
        first, last = int(query_start[b]), int(query_start[b + 1])
        start, n = int(context_start[b]), last - first
        positions = torch.arange(start + n, device=query.device)
        slots = block_tables[b, positions // block_size] * block_size + positions % block_size
        keys = read_slots(key_cache, slots).float().repeat_interleave(group, dim=1)  # [L, H, Dh]
        values = read_slots(value_cache, slots).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[first:last].float() * scale, keys)  # [H, n, L]
        visible = _visible(start, n, tree_mask, int(tree_offsets[b]), query.device)  # [n, L]
        weights = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[first:last] = torch.einsum("hqk,khd->qhd", weights, values).to(query.dtype)
    return out


def _visible(start: int, n: int, tree_mask: torch.Tensor | None, tree_offset: int, device) -> torch.Tensor:
    """[n, start + n] which keys each new token sees."""
    prefix = torch.ones(n, start, dtype=torch.bool, device=device)
    if tree_offset < 0:
        new = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    else:
        new = tree_mask[tree_offset:tree_offset + n * n].view(n, n).bool()
    return torch.cat([prefix, new], dim=1)
