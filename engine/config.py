"""Where and in what precision the engine computes: the one place device and dtype are chosen."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}
AUTO = "auto"
# CPU flags of hardware bf16 matmuls: AVX-512 BF16 (Cooper Lake, Zen 4 on) and AMX (Sapphire Rapids on).
_CPU_BF16_FLAGS = {"avx512_bf16", "amx_bf16"}


@dataclass(frozen=True)
class EngineConfig:
    """Weights, activations and the KV cache live on `device` in `dtype`; logits are always fp32."""
    device: str = "cpu"
    dtype: torch.dtype = torch.float32

    @classmethod
    def parse(cls, device: str = "cpu", dtype: str = "float32") -> EngineConfig:
        """From the string forms a command line gives, e.g. ("cuda:0", "bf16"). `auto` device: CUDA
        when there is a GPU, else the CPU; `auto` dtype: bf16 where the hardware runs it fast (CUDA,
        CPUs with AVX-512 BF16 or AMX), fp32 elsewhere."""
        if device == AUTO:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            torch.device(device)
        except RuntimeError as e:
            raise ValueError(f"unknown device {device!r}") from e
        if dtype.lower() == AUTO:
            return cls(device, torch.bfloat16 if runs_bf16_fast(device) else torch.float32)
        if dtype.lower() not in DTYPE_NAMES:
            raise ValueError(f"unknown dtype {dtype!r}; expected auto or one of {', '.join(DTYPE_NAMES)}")
        return cls(device=device, dtype=DTYPE_NAMES[dtype.lower()])

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def runs_bf16_fast(device: str) -> bool:
    if torch.device(device).type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool(_CPU_BF16_FLAGS & _cpu_flags())


def _cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags (Linux); none where /proc/cpuinfo is not."""
    if not cpuinfo.exists():
        return set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()
