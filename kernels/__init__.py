"""Verification kernels: tensors in, tensors out.

A verification batch is flattened, never padded: sequence b owns draft tokens
`draft_token_ids[cu_draft_lens[b]:cu_draft_lens[b+1]]` and target rows
`cu_draft_lens[b] + b .. cu_draft_lens[b+1] + b` (one row per draft position plus
the bonus row). `target_svc` calls these functions only through this module,
which picks the implementation by device.
"""
from kernels.dispatch import greedy_accept, rejection_sample, target_row_offsets

__all__ = ["greedy_accept", "rejection_sample", "target_row_offsets"]
