"""Paged attention in Triton: one program per (query row, KV head), reading the cache in place.

Same signature and results as `kernels.reference.attention.paged_attention`.
A program holds the query heads that share one KV head, walks the sequence's
keys through its block table BLOCK_N positions at a time with an online
softmax, and applies the chain or tree visibility rule per key. Each query row
is computed by one program in a fixed order, so a row's result does not depend
on the rest of the batch. Meant for decoding and verification (a handful of
queries per sequence); prompts prefilled from their first token go through
SDPA in the engine.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.layout import segment_ids

_BLOCK_N = 64  # key positions per step


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start: torch.Tensor, context_start: torch.Tensor,
                    tree_mask: torch.Tensor | None, tree_offsets: torch.Tensor, block_size: int,
                    scale: float) -> torch.Tensor:
    num_rows, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    if query.stride(2) != 1 or query.stride(1) != head_dim:
        raise ValueError("each query row's heads must be contiguous")
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_rows == 0:
        return out
    seq_of_row = segment_ids(query_start)  # [T], on the device: no host round trip
    has_tree = tree_mask is not None
    # Bytes, not bools (Triton loads bool pointers badly); any valid pointer when there is no tree.
    mask = tree_mask.view(torch.uint8) if has_tree else query_start
    _paged_attention_kernel[(num_rows, num_kv_heads)](
        query, key_cache.contiguous(), value_cache.contiguous(), out, block_tables.contiguous(), query_start,
        context_start, mask, tree_offsets, seq_of_row, query.stride(0), block_tables.shape[1], block_size, scale,
        num_heads // num_kv_heads, num_kv_heads, head_dim,
        GROUP=triton.next_power_of_2(num_heads // num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=_BLOCK_N, HAS_TREE=has_tree)
    return out


@triton.jit
def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, query_start_ptr, context_start_ptr,
                            tree_mask_ptr, tree_offsets_ptr, seq_of_row_ptr, q_stride, table_width, block_size,
                            scale, group, num_kv_heads, head_dim, GROUP: tl.constexpr, BLOCK_D: tl.constexpr,
                            BLOCK_N: tl.constexpr, HAS_TREE: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(seq_of_row_ptr + row)
    first = tl.load(query_start_ptr + seq)
    num_new = tl.load(query_start_ptr + seq + 1) - first
    local = row - first  # the query's index among its sequence's new tokens
    start = tl.load(context_start_ptr + seq)
    tree_offset = tl.load(tree_offsets_ptr + seq)
    limit = tl.where(tree_offset >= 0, start + num_new, start + local + 1)  # past every position the query sees

    g = tl.arange(0, GROUP)
    d = tl.arange(0, BLOCK_D)
    head_ok = g < group
    d_ok = d < head_dim
    heads = kv_head * group + g
    q = tl.load(q_ptr + row * q_stride + heads[:, None] * head_dim + d[None, :],
                mask=head_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32) * scale  # [GROUP, BLOCK_D]

    running_max = tl.full([GROUP], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP], tl.float32)
    acc = tl.zeros([GROUP, BLOCK_D], tl.float32)
    for chunk in range(0, limit, BLOCK_N):
        pos = chunk + tl.arange(0, BLOCK_N)
        in_range = pos < limit
        block = tl.load(tables_ptr + seq * table_width + pos // block_size, mask=in_range, other=0)
        entry = ((block * block_size + pos % block_size) * num_kv_heads + kv_head) * head_dim  # [BLOCK_N]
        kv_mask = in_range[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + entry[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptr + entry[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        visible = in_range
        if HAS_TREE:
            if tree_offset >= 0:  # a tree query sees the cached prefix and its ancestors among the new tokens
                is_new = (pos >= start) & in_range
                ancestor = tl.load(tree_mask_ptr + tree_offset + local * num_new + (pos - start), mask=is_new,
                                   other=0)
                visible = in_range & ((pos < start) | (ancestor != 0))
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP, BLOCK_N]
        scores = tl.where(visible[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # nothing visible yet: weights stay 0
        rescale = tl.exp(running_max - safe_max)
        weights = tl.exp(scores - safe_max[:, None])
        running_sum = running_sum * rescale + tl.sum(weights, axis=1)
        acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * v[None, :, :], axis=1)
        running_max = new_max

    out = acc / running_sum[:, None]
    tl.store(out_ptr + (row * group * num_kv_heads + heads[:, None]) * head_dim + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & d_ok[None, :])
