"""C++ kernels for CPU tensors, compiled on first use by torch's extension builder and cached.

Where the extension cannot be built (no compiler, no ninja) `compiled()` is
False and `kernels.dispatch` runs the PyTorch references instead: the same
results up to rounding, but slower and not batch invariant. `make install`
builds it ahead of time, so services start without a compile.
"""
from __future__ import annotations

import fcntl
import functools
import logging
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
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
PRODUCTS_VARIABLE = "SPECD_LINEAR_PRODUCTS"  # "dot" or "widened" for every call (default: `linear_products`)
# Widened products pay for widening the rows first: forwards of the default model at batch 1 with them alone
# took, against dot products alone, 0.92x the speed at 1 token, 0.95x at 2, even at 4, 1.1x at 8, 1.2x at 16
# (a Xeon without AMX, bf16, 2 threads, `benchmarks/step_cost.py`).
WIDENED_FROM_ROWS = 8
# Of widened products over dot products at 16 rows, for taking them at all: on the Xeon above they measure
# 1.45-1.48x alone, but under 1.2x (best of 5 one way, then best of 5 the other) in a target starting beside
# two others; where dot products issue at full rate they should be about twice as fast as the FMAs.
CLEARLY_FASTER = 1.1


@functools.cache
def compiled() -> bool:
    """Build (or load the cached build of) the extension; False where it cannot be built."""
    from torch.utils import cpp_extension
    directory = build_directory()
    try:
        with build_lock(directory):
            cpp_extension.load(name="specd_cpu_kernels", sources=[str(s) for s in SOURCES], extra_cflags=CFLAGS,
                               extra_ldflags=LDFLAGS, is_python_module=False, verbose=False,
                               build_directory=str(directory))
    except (OSError, RuntimeError, ImportError) as error:  # no compiler, no ninja, a failed build
        log.warning("CPU kernels unavailable, using the PyTorch references: %s", error)
        return False
    return True


def build_directory() -> Path:
    """Where the extension is built and cached: under torch's extension root, one folder per Python and torch
    build (a torch of another version or accelerator would not load it)."""
    from torch.utils import cpp_extension
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return Path(root) / "specd_cpu_kernels" / f"{python}-torch{torch.__version__}"


@contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Held while the extension is built or loaded in `directory`, one process at a time. Torch's own lock is a
    file that outlives a build killed half way, and every later build waits on it for ever; an flock is
    released when its process dies, so the holder of this one knows that a torch lock it finds is stale."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "specd.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        yield


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
    """Whether `linear` (linear.cpp: bf16 products by AMX tiles, AVX512-BF16 dot products or widened fp32
    FMAs; fp32 by fp32 FMAs) can take `weight` [N, K]: not where it has another dtype, N is not a multiple of
    16 (or, in bf16, K of 32), or the CPU has no AVX512F."""
    return compiled() and torch.ops.specd.supports_linear(weight)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [N, K] packed for `linear`, or None where that kernel cannot take it."""
    return _op("pack_linear_weight")(weight) if takes_linear_weight(weight) else None


def linear(x: torch.Tensor, packed: torch.Tensor, products: str | None = None) -> torch.Tensor:
    """x [M, K] @ weight^T -> [M, N], the weight as `pack_linear_weight` returned it; each output row
    bit-identical whatever the row count (linear.cpp). `products`: how they are formed (one of
    `torch.ops.specd.linear_products()`), by default as this process's `linear_products()` says for M rows;
    fp32 weights have one way, "fma" (fp32 FMAs)."""
    if packed.dtype == torch.float32:
        return _op("linear")(x, packed, products or "fma")
    return _op("linear")(x, packed, products or linear_products().for_rows(x.shape[0]))


@dataclass(frozen=True)
class LinearProducts:
    """How `linear` forms its products: `few` for calls of fewer than `many_from` rows, `many` from there."""
    few: str
    many: str
    many_from: int

    def for_rows(self, rows: int) -> str:
        return self.many if rows >= self.many_from else self.few

    def describe(self) -> str:
        return self.few if self.few == self.many else f"{self.few}, {self.many} from {self.many_from} rows"


@functools.cache
def linear_products() -> LinearProducts:
    """How this process's `linear` forms its products: AMX tiles where the process is granted them; else
    AVX512-BF16 dot products, and widened fp32 FMAs instead from WIDENED_FROM_ROWS rows where those round bit
    for bit as the dot products do (checked) and run CLEARLY_FASTER (measured, ~10 ms): a row's result is
    then the same whichever forms it, so the choice can go by the row count. PRODUCTS_VARIABLE names one way
    for every call instead, for comparing them."""
    ways = list(_op("linear_products")())
    named = os.environ.get(PRODUCTS_VARIABLE)
    if named:
        if named not in ways:
            raise ValueError(f"{PRODUCTS_VARIABLE}={named!r}: this CPU can form {', '.join(ways)}")
        chosen = LinearProducts(named, named, 0)
    elif ways[:2] == ["dot", "widened"] and _widened_rounds_as_dot() and _widened_speedup() >= CLEARLY_FASTER:
        chosen = LinearProducts("dot", "widened", WIDENED_FROM_ROWS)
    else:
        chosen = LinearProducts(ways[0], ways[0], 0)
    log.info("bf16 matmul products: %s (this CPU forms %s)", chosen.describe(), ", ".join(ways))
    return chosen


def _widened_rounds_as_dot() -> bool:
    """Whether widened products give every output bit for bit as dot products do, on random weights and rows
    of several magnitudes."""
    generator = torch.Generator().manual_seed(0)
    packed = _op("pack_linear_weight")(torch.randn(64, 576, generator=generator).bfloat16())
    for scale in (1.0, 1e-3, 1e3):
        x = (torch.randn(9, 576, generator=generator) * scale).bfloat16()
        if not torch.equal(_op("linear")(x, packed, "dot"), _op("linear")(x, packed, "widened")):
            return False
    return True


def _widened_speedup(rows: int = 16, tries: int = 10) -> float:
    """How many times faster widened products run a `rows`-row call of an MLP-sized weight than dot products
    do: the best of `tries` of each, taken in turn, so that a busy moment (other services starting beside this
    one) slows both alike or only a try that does not count."""
    generator = torch.Generator().manual_seed(0)
    packed = _op("pack_linear_weight")(torch.randn(1536, 576, generator=generator).bfloat16())
    x = torch.randn(rows, 576, generator=generator).bfloat16()
    best = {"dot": math.inf, "widened": math.inf}
    for _ in range(tries):
        for way in best:
            _op("linear")(x, packed, way)
            started = time.perf_counter()
            for _ in range(4):
                _op("linear")(x, packed, way)
            best[way] = min(best[way], time.perf_counter() - started)
    return best["dot"] / best["widened"]


def _op(name: str):
    if not compiled():
        raise RuntimeError("the CPU kernels could not be built here; use kernels.dispatch, which falls back")
    return getattr(torch.ops.specd, name)
