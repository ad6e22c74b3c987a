"""Plain PyTorch implementations of every kernel (any device): the specification."""
from kernels.reference.attention import paged_attention
from kernels.reference.chain import greedy_accept, rejection_sample, sample_recovered
from kernels.reference.kv import compact_kv, write_kv
from kernels.reference.layers import add_rms_norm, rotate, silu_mul
from kernels.reference.tree import build_tree_attention, tree_greedy_accept, tree_rejection_sample

__all__ = ["add_rms_norm", "build_tree_attention", "compact_kv", "greedy_accept", "paged_attention",
           "rejection_sample", "rotate", "sample_recovered", "silu_mul", "tree_greedy_accept", "tree_rejection_sample",
           "write_kv"]
