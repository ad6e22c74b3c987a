"""Paged attention in Triton: one program per (query row, KV head), reading the cache in place.

Same signature and results as `kernels.reference.attention.paged_attention`.
A program holds the query heads that share one KV head, walks the sequence's
keys through its block table BLOCK_N positions at a time with an online
softmax. Each query row is computed by one program in a fixed order, so a row's
result does not depend on the rest of the batch; and a tree node's is the one it
would get decoded alone after its ancestors: the program lays the ancestors out
where a decode would find them (the one at depth j at position start + j), not
where the tree put them, since a lane's place in a reduction decides how it rounds
(with keys at their tree positions, 2 of 26 greedy Spec-Bench outputs of `suffix`
on an H200 differed from `none`'s). Meant for decoding and verification (a handful of
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
    is_tree = tree_offset >= 0
    ancestors_row = tree_mask_ptr + tree_offset + local * num_new  # the query's ancestor-or-self mask
    depth = local  # in a chain, a query's index is its depth
    if HAS_TREE:
        if is_tree:
            depth = depth * 0 - 1
            for node in range(0, num_new):
                depth += (tl.load(ancestors_row + node) != 0).to(depth.dtype)
    limit = start + depth + 1  # past every position the query sees, as a decode at its depth would

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
        cached_at = pos  # where the key at each position is in the cache
        if HAS_TREE:
            if is_tree and chunk + BLOCK_N > start:  # the ancestor of depth j at position start + j
                node_at = pos - start
                ancestors_seen = 0
                for node in range(0, num_new):
                    is_ancestor = tl.load(ancestors_row + node) != 0
                    node_at = tl.where(is_ancestor & (pos - start == ancestors_seen), node, node_at)
                    ancestors_seen += is_ancestor.to(tl.int32)
                cached_at = tl.where(pos >= start, start + node_at, pos).to(cached_at.dtype)
        block = tl.load(tables_ptr + seq * table_width + cached_at // block_size, mask=in_range, other=0)
        entry = ((block * block_size + cached_at % block_size) * num_kv_heads + kv_head) * head_dim  # [BLOCK_N]
        kv_mask = in_range[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + entry[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptr + entry[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP, BLOCK_N]
        scores = tl.where(in_range[None, :], scores, float("-inf"))
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
