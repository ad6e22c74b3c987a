"""The one place that chooses a kernel implementation, per call.

Triton kernels for CUDA tensors; for CPU tensors the compiled C++ kernels
(`kernels.cpu`: attention, KV writes, 16-bit layer ops, bf16 AMX matmuls) where
they build, the PyTorch references for everything else.
`SPECD_KERNELS=triton|torch` overrides the choice; it is read at every call.
`triton` is optional: without it everything runs on the references. With
`SPECD_KERNELS=triton` and `TRITON_INTERPRET=1`, the Triton kernels run on CPU
tensors through Triton's interpreter.
"""
from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from types import ModuleType

import torch

from kernels import cpu, reference

_CHOICES = ("triton", "torch")


def implementation(device: torch.device) -> ModuleType:
    """The module whose kernels run on tensors of `device`: kernels.triton_impl or kernels.reference."""
    choice = os.environ.get("SPECD_KERNELS", "")
    if choice and choice not in _CHOICES:
        raise ValueError(f"SPECD_KERNELS={choice!r}: expected one of {', '.join(_CHOICES)} (or unset)")
    if choice == "torch" or (choice != "triton" and device.type != "cuda"):
        return reference  # without importing triton: CPU tensors never need it unless asked
    triton_impl = triton_implementation()
    if triton_impl is not None:
        return triton_impl
    if choice == "triton":
        raise RuntimeError("SPECD_KERNELS=triton, but the `triton` package is not installed "
                           "(pip install 'specd[triton]')")
    return reference


def triton_implementation() -> ModuleType | None:
    """kernels.triton_impl, or None when triton is not installed (imported on first use, not before)."""
    try:
        return importlib.import_module("kernels.triton_impl")
    except ModuleNotFoundError as error:
        if error.name != "triton" and not (error.name or "").startswith("triton."):
            raise
        return None


def prepare(device: torch.device) -> None:
    """Build now what the kernels for `device` need (the CPU extension), not in the first request."""
    _attention_module(device)


def attention_backend(device: torch.device) -> str:
    """Which paged-attention implementation runs on `device`: "cpu" (C++), "triton" or "reference"."""
    return _attention_module(device).__name__.rsplit(".", 1)[-1].removesuffix("_impl")


def _attention_module(device: torch.device) -> ModuleType:
    """implementation(device), except that CPU tensors take the compiled kernel where it builds."""
    if device.type == "cpu" and not os.environ.get("SPECD_KERNELS") and cpu.compiled():
        return cpu
    return implementation(device)


def packs_caches(device: torch.device) -> bool:
    """Whether the attention kernel for `device` reads packed caches (kernels.layout): the C++ and
    reference kernels do, the Triton kernel reads [slots, KV, Dh]."""
    return attention_backend(device) != "triton"


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start: torch.Tensor, context_start: torch.Tensor,
                    tree_mask: torch.Tensor | None, tree_offsets: torch.Tensor, block_size: int,
                    scale: float) -> torch.Tensor:
    """See `kernels.reference.attention.paged_attention`."""
    return _attention_module(query.device).paged_attention(
        query, key_cache, value_cache, block_tables, query_start, context_start, tree_mask, tree_offsets,
        block_size, scale)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """See `kernels.reference.layers.add_rms_norm`. On CUDA, Triton's where it is installed (one launch, not eight)."""
    module = implementation(h.device) if h.device.type == "cuda" else _layer_module(h)
    return module.add_rms_norm(h, delta, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """See `kernels.reference.layers.silu_mul`."""
    return _layer_module(gate_up).silu_mul(gate_up)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """See `kernels.reference.layers.rotate`."""
    return _layer_module(x).rotate(x, cos, sin)


def _layer_module(t: torch.Tensor) -> ModuleType:
    """The fused C++ layer ops for 16-bit CPU tensors where they build; the references (transformers'
    ops, which the fp32 path must match bit for bit) everywhere else."""
    if t.dtype in (torch.bfloat16, torch.float16) and _attention_module(t.device) is cpu:
        return cpu
    return reference


def packs_linear_weight(weight: torch.Tensor) -> bool:
    """Whether a kernel for `weight`'s device, dtype and shape exists behind `packed_linear` (fp32 and bf16
    on CPUs with AVX512F, `kernels.cpu.linear`)."""
    return _attention_module(weight.device) is cpu and cpu.takes_linear_weight(weight)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` packed for `packed_linear` where `packs_linear_weight`, else None: the caller keeps its
    own matmul."""
    return cpu.pack_linear_weight(weight) if packs_linear_weight(weight) else None


def packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x @ weight^T for a weight from `pack_linear_weight`; rows independent of the row count."""
    return cpu.linear(x, packed)


def greedy_accept(draft_token_ids: torch.Tensor, cu_draft_lens: torch.Tensor,
                  target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See `kernels.reference.chain.greedy_accept`."""
    return implementation(target_argmax.device).greedy_accept(draft_token_ids, cu_draft_lens, target_argmax)


def rejection_sample(draft_token_ids: torch.Tensor, cu_draft_lens: torch.Tensor, target_probs: torch.Tensor,
                     draft_probs: torch.Tensor | None, uniform_accept: torch.Tensor,
                     uniform_final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See `kernels.reference.chain.rejection_sample`."""
    return implementation(target_probs.device).rejection_sample(
        draft_token_ids, cu_draft_lens, target_probs, draft_probs, uniform_accept, uniform_final)


def sample_recovered(draft_token_ids: torch.Tensor, cu_draft_lens: torch.Tensor, target_probs: torch.Tensor,
                     draft_probs: torch.Tensor | None, num_accepted: torch.Tensor,
                     uniform_final: torch.Tensor) -> torch.Tensor:
    """See `kernels.reference.chain.sample_recovered`."""
    return implementation(target_probs.device).sample_recovered(
        draft_token_ids, cu_draft_lens, target_probs, draft_probs, num_accepted, uniform_final)


def tree_greedy_accept(draft_token_ids: torch.Tensor, parent_ids: torch.Tensor, cu_draft_lens: torch.Tensor,
                       target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See `kernels.reference.tree.tree_greedy_accept`."""
    return implementation(target_argmax.device).tree_greedy_accept(
        draft_token_ids, parent_ids, cu_draft_lens, target_argmax)


def tree_rejection_sample(draft_token_ids: torch.Tensor, parent_ids: torch.Tensor, cu_draft_lens: torch.Tensor,
                          target_probs: torch.Tensor, uniform_accept: torch.Tensor,
                          uniform_final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See `kernels.reference.tree.tree_rejection_sample`."""
    return implementation(target_probs.device).tree_rejection_sample(draft_token_ids, parent_ids, cu_draft_lens,
                                                                     target_probs, uniform_accept, uniform_final)


def build_tree_attention(parent_ids: torch.Tensor, cu_draft_lens: torch.Tensor,
                         start_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See `kernels.reference.tree.build_tree_attention`."""
    return implementation(parent_ids.device).build_tree_attention(parent_ids, cu_draft_lens, start_positions)


def write_kv(key_pool: torch.Tensor, value_pool: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             slots: torch.Tensor) -> None:
    """See `kernels.reference.kv.write_kv`; one C++ call per layer for the packed CPU caches."""
    (cpu if _packed_on_cpu(key_pool) else reference).write_kv(key_pool, value_pool, keys, values, slots)


def compact_kv(pools: Sequence[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """See `kernels.reference.kv.compact_kv`; one C++ call for the packed CPU caches of every layer."""
    on_cpu = bool(pools) and _packed_on_cpu(pools[0])
    (cpu if on_cpu else implementation(src_slots.device)).compact_kv(pools, src_slots, dst_slots)


def _packed_on_cpu(pool: torch.Tensor) -> bool:
    """Whether `pool` is a packed K or V cache (kernels.layout) the C++ kernels serve."""
    return pool.dim() != 3 and _attention_module(pool.device) is cpu
