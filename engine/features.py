"""The target's features (final-normed hidden states) as bytes and back: how they travel to drafters that
draft from them (EAGLE), compact, in a 16-bit dtype."""
from __future__ import annotations

import torch

from engine.config import DTYPE_NAMES

WIRE_DTYPE = torch.bfloat16


def to_bytes(features: torch.Tensor) -> tuple[str, bytes]:
    """[n, D] -> (dtype name, row-major little-endian bytes) in WIRE_DTYPE."""
    rows = features.detach().to(device="cpu", dtype=WIRE_DTYPE).contiguous()
    return str(WIRE_DTYPE).removeprefix("torch."), rows.view(torch.int16).numpy().tobytes()


def from_bytes(data: bytes, dtype: str, hidden_size: int) -> torch.Tensor:
    """The [n, hidden_size] tensor `to_bytes` gave; ValueError if the sizes or the dtype do not fit."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {dtype!r}")
    torch_dtype = DTYPE_NAMES[dtype]
    row_bytes = hidden_size * torch_dtype.itemsize
    if hidden_size <= 0 or len(data) % row_bytes:
        raise ValueError(f"{len(data)} bytes are not rows of {hidden_size} {dtype} values")
    if not data:
        return torch.empty(0, hidden_size, dtype=torch_dtype)
    return torch.frombuffer(bytearray(data), dtype=torch_dtype).view(-1, hidden_size)


class FeatureLog:
    """A sequence's features by position, for positions 0..length-1 (grown as tokens are committed): of the
    target `layers` (their inputs, concatenated), or () the final-normed output."""

    def __init__(self, layers: tuple[int, ...] = ()):
        self.layers = layers
        self._rows: torch.Tensor | None = None  # [capacity, D] in WIRE_DTYPE, on the CPU
        self.length = 0

    def write(self, position: int, rows: torch.Tensor) -> None:
        """rows [n, D] are the features of positions position..position+n-1 (a recomputed prefix rewrites them)."""
        if position > self.length:
            raise ValueError(f"features at {position} would leave a gap after {self.length}")
        end = position + rows.shape[0]
        if self._rows is None or end > self._rows.shape[0]:
            grown = torch.empty(max(2 * end, 64), rows.shape[1], dtype=WIRE_DTYPE)
            if self._rows is not None:
                grown[:self.length] = self._rows[:self.length]
            self._rows = grown
        self._rows[position:end] = rows.to(device="cpu", dtype=WIRE_DTYPE)
        self.length = max(self.length, end)

    def truncate(self, length: int) -> None:
        """Forget the features of positions length and on."""
        self.length = min(self.length, length)

    def rows(self, start: int, end: int) -> torch.Tensor:
        """[end - start, D]"""
        assert self._rows is not None and 0 <= start <= end <= self.length
        return self._rows[start:end]
