"""Where and in what precision the engine computes: the one place device and dtype are chosen."""
from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


@dataclass(frozen=True)
class EngineConfig:
    """Weights, activations and the KV cache live on `device` in `dtype`; logits are always fp32."""
    device: str = "cpu"
    dtype: torch.dtype = torch.float32

    @classmethod
    def parse(cls, device: str = "cpu", dtype: str = "float32") -> EngineConfig:
        """From the string forms a command line gives, e.g. ("cuda:0", "bf16")."""
        if dtype.lower() not in DTYPE_NAMES:
            raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPE_NAMES)}")
        try:
            torch.device(device)
        except RuntimeError as e:
            raise ValueError(f"unknown device {device!r}") from e
        return cls(device=device, dtype=DTYPE_NAMES[dtype.lower()])
