"""Llama's row-wise layer ops in plain PyTorch, op for op as transformers computes them: the specification
of the fused CPU kernels (kernels/cpu/layers.cpp), and what runs in fp32 and off the CPU."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h [T, D] += delta (in place, where given); returns RMSNorm(h) * weight, the statistics in fp32 and the
    normalised rows cast back to h's dtype before the weight (as LlamaRMSNorm)."""
    if delta is not None:
        h.add_(delta)
    h32 = h.float()  # no copy when h is fp32
    return weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate, then up) -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding: x [T, heads, Dh], cos and sin [T, Dh/2] -> [T, heads, Dh]; transformers'
    `x*cos + rotate_half(x)*sin` on the half-width tables."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
