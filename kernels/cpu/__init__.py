"""C++ kernels for CPU tensors, compiled on first use by torch's extension builder and cached.

Where the extension cannot be built (no compiler, no ninja) `compiled()` is
False and `kernels.dispatch` runs the PyTorch references instead: the same
results up to rounding, but slower and not batch invariant. `make install`
builds it ahead of time, so services start without a compile.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name) for name in ("paged_attention.cpp", "layers.cpp", "linear.cpp",
                                                           "kv_write.cpp")]
# -march=native: the extension is compiled where it runs (cached per machine under
# torch's extension directory), so it may use every vector unit that machine has.
CFLAGS = ["-O3", "-march=native", "-std=c++17", "-fopenmp"]
# at::parallel_for is OpenMP in torch's CPU builds, inlined from its headers: without -fopenmp it runs
# on one thread. Linked as libgomp.so.1, the runtime torch has already loaded is the one used.
LDFLAGS = ["-fopenmp"]


@functools.cache
def compiled() -> bool:
    """Build (or load the cached build of) the extension; False where it cannot be built."""
    from torch.utils import cpp_extension
    try:
        cpp_extension.load(name="specd_cpu_kernels", sources=[str(s) for s in SOURCES], extra_cflags=CFLAGS,
                           extra_ldflags=LDFLAGS, is_python_module=False, verbose=False)
    except (OSError, RuntimeError, ImportError) as error:  # no compiler, no ninja, a failed build
        log.warning("CPU kernels unavailable, using the PyTorch references: %s", error)
        return False
    return True


def paged_attention(*args) -> torch.Tensor:
    """`kernels.reference.attention.paged_attention` (same arguments, in order), batch invariant
    (see paged_attention.cpp)."""
    return _op("paged_attention")(*args)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`kernels.reference.layers.add_rms_norm` for bf16 and fp16 (layers.cpp)."""
    return _op("add_rms_norm")(h, delta, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`kernels.reference.layers.silu_mul` for bf16 and fp16 (layers.cpp)."""
    return _op("silu_mul")(gate_up)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`kernels.reference.layers.rotate` for bf16 and fp16 (layers.cpp)."""
    return _op("rotate")(x, cos, sin)


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             slots: torch.Tensor) -> None:
    """`kernels.reference.kv.write_kv` for packed caches (kv_write.cpp)."""
    _op("write_kv")(key_cache, value_cache, keys, values, slots)


def compact_kv(pools: Sequence[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """`kernels.reference.kv.compact_kv` for packed caches, every pool in one call (kv_write.cpp)."""
    _op("compact_kv")(list(pools), src_slots, dst_slots)


def takes_linear_weight(weight: torch.Tensor) -> bool:
    """Whether `linear` (linear.cpp: bf16 AMX tile products or AVX512-BF16 dot products) can take `weight`
    [N, K]: not where it has another dtype, N is not a multiple of 16 or K of 32, or the CPU has neither."""
    return compiled() and torch.ops.specd.supports_linear(weight)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [N, K] packed for `linear`, or None where that kernel cannot take it."""
    return _op("pack_linear_weight")(weight) if takes_linear_weight(weight) else None


def linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight^T -> [M, N], the weight as `pack_linear_weight` returned it; each output row
    bit-identical whatever the row count (linear.cpp)."""
    return _op("linear")(x, packed)


def _op(name: str):
    if not compiled():
        raise RuntimeError("the CPU kernels could not be built here; use kernels.dispatch, which falls back")
    return getattr(torch.ops.specd, name)
