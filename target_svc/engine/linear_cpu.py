"""The engine's matmul, `x @ weight^T`: on CPU in fp32, the GEMM formulation measured fastest for the row count."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# Which fp32 GEMM formulation is fastest depends on the row count M (the new
# tokens) and the thread count, by up to 4x. Measured with torch 2.13 (MKL +
# oneDNN) on a 2-core AMD EPYC over weights shaped like the default model's
# (30 layers + vocab projection), in ms per forward:
#
#   M                        1    2    4    8   16   32  256
#   2 threads  F.linear     52   94   71   67   80  113  534
#              transposed   23   24   34   54   77  109  598
#              oneDNN       32   47   50   57   73   97  477
#   1 thread   F.linear     53   94   72   84  113  167  968
#              transposed   38   37   58   98  136  200 1103
#              oneDNN       47   83   89  100  129  183  960
#
# "transposed" is MKL's GEMM with the few rows as its small n side, i.e.
# (weight @ x^T)^T, rows padded to 2, 4 or 8 (n = 1 drops to a slow GEMV).
#
# bf16 and fp16 use F.linear: in bf16 the three formulations are within ~15% of
# each other (2 threads: ~11-13 ms at M = 1 and 8, ~14-17 ms at 32), and
# F.linear's rows are bit-identical whatever the row count.


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K], weight [N, K] -> x @ weight^T [M, N], by the formulation measured fastest for M."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return F.linear(x, weight)
    rows, single_thread = x.shape[0], torch.get_num_threads() == 1
    if rows <= (4 if single_thread else 8):
        return transposed_linear(x, weight)
    if (rows > 128 or not single_thread) and onednn_available():
        return onednn_linear(x, weight)
    return F.linear(x, weight)


def transposed_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T computed as (weight @ x^T)^T, rows padded to a power of two of at least 2."""
    rows = x.shape[0]
    padded = max(2, 1 << max(rows - 1, 0).bit_length())
    x_pad = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])]) if padded > rows else x  # [p, K]
    return torch.mm(weight, x_pad.t()).t()[:rows].contiguous()


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T by oneDNN: a private op (the one torch.compile's CPU backend emits)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


@functools.cache
def onednn_available() -> bool:
    """Whether this torch build runs `onednn_linear`; probed once, on the first call (never at import)."""
    try:
        onednn_linear(torch.ones(9, 2), torch.ones(3, 2))
    except (AttributeError, RuntimeError):
        return False
    return True
