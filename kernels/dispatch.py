"""The one place that chooses a kernel implementation.

Only the PyTorch references exist so far; they run on any device.
"""
from kernels.reference import greedy_accept, rejection_sample, target_row_offsets

__all__ = ["greedy_accept", "rejection_sample", "target_row_offsets"]
