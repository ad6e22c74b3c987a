"""The engine's kernels: paged attention and verification, tensors in, tensors out.

A verification batch is flattened, never padded: sequence b owns draft tokens
`draft_token_ids[cu_draft_lens[b]:cu_draft_lens[b+1]]` and target rows
`cu_draft_lens[b] + b .. cu_draft_lens[b+1] + b` (its last committed token, then
one row per draft; see `kernels.layout`). Tree drafts add `parent_ids`, laid out
like the drafts. `target_svc` calls these functions only through this module,
which picks the implementation per call (`kernels.dispatch`): Triton on CUDA,
compiled C++ for attention, 16-bit layer ops and bf16 matmuls on
CPU (`kernels.cpu`), the PyTorch references (`kernels.reference`) elsewhere.
"""
from kernels.dispatch import (add_rms_norm, attention_backend, build_tree_attention, compact_kv, greedy_accept,
                              pack_linear_weight, packed_linear, packs_caches, packs_linear_weight,
                              paged_attention, prepare, rejection_sample, rotate, sample_recovered, silu_mul,
                              tree_greedy_accept, tree_rejection_sample, write_kv)
from kernels.layout import (packed_key_shape, packed_value_shape, read_slots, target_row_offsets, tree_mask_offsets,
                            write_slots)

__all__ = ["add_rms_norm", "attention_backend", "build_tree_attention", "compact_kv", "greedy_accept",
           "pack_linear_weight", "packed_key_shape", "packed_linear", "packed_value_shape", "packs_caches",
           "packs_linear_weight", "paged_attention", "prepare", "read_slots", "rejection_sample", "rotate",
           "sample_recovered", "silu_mul",
           "target_row_offsets", "tree_greedy_accept", "tree_mask_offsets", "tree_rejection_sample", "write_kv",
           "write_slots"]
