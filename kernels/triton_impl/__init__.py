"""Triton implementations of the kernels (CUDA; CPU tensors through TRITON_INTERPRET=1).

Importing this module imports `triton`; `kernels.dispatch` imports it on first
use, and only when triton is installed. Each function has its reference's
signature and gives the same outputs for the same inputs.
"""
from kernels.triton_impl.attention import paged_attention
from kernels.triton_impl.chain import greedy_accept, rejection_sample, sample_recovered
from kernels.triton_impl.kv import compact_kv
from kernels.triton_impl.layers import add_rms_norm
from kernels.triton_impl.tree import build_tree_attention, tree_greedy_accept, tree_rejection_sample

__all__ = ["add_rms_norm", "build_tree_attention", "compact_kv", "greedy_accept", "paged_attention",
           "rejection_sample", "sample_recovered", "tree_greedy_accept", "tree_rejection_sample"]
