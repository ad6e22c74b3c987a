"""RMSNorm (with the residual add before it) in Triton: one launch where PyTorch's ops take eight, each row
reduced by one program in one fixed order, so a row's result does not depend on the row count.

On an H200, decoding the default model's 30 layers took 23 ms a step with PyTorch's norm and 13 ms with this
one: at 135M parameters a GPU step is bound by its kernel launches."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As `kernels.reference.layers.add_rms_norm`: h [T, D] += delta in place (where given), returns
    RMSNorm(h) * weight; each row reduced by one program."""
    if not h.is_contiguous() or (delta is not None and not delta.is_contiguous()):
        raise ValueError("add_rms_norm: h and delta must be contiguous")
    tokens, width = h.shape
    out = torch.empty_like(h)
    if tokens:
        _add_rms_norm_kernel[(tokens,)](h, h if delta is None else delta, weight, out, width, eps,
                                        HAS_DELTA=delta is not None, BLOCK_D=triton.next_power_of_2(width))
    return out


@triton.jit
def _add_rms_norm_kernel(h_ptr, delta_ptr, weight_ptr, out_ptr, width, eps, HAS_DELTA: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    in_row = d < width
    h32 = tl.load(h_ptr + row * width + d, mask=in_row, other=0.0).to(tl.float32)
    if HAS_DELTA:  # summed in fp32 and rounded to h's dtype, as h.add_(delta)
        h32 += tl.load(delta_ptr + row * width + d, mask=in_row, other=0.0).to(tl.float32)
        h32 = h32.to(h_ptr.dtype.element_ty).to(tl.float32)
        tl.store(h_ptr + row * width + d, h32.to(h_ptr.dtype.element_ty), mask=in_row)
    inverse_rms = 1.0 / tl.sqrt(tl.sum(h32 * h32, axis=0) / width + eps)
    normed = (h32 * inverse_rms).to(h_ptr.dtype.element_ty)  # cast back before the weight, as LlamaRMSNorm
    weight = tl.load(weight_ptr + d, mask=in_row, other=0.0)
    tl.store(out_ptr + row * width + d, (weight.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=in_row)
