"""The engine's matmul, `x @ weight^T`: on CPU, specd's packed kernel where the CPU has AVX512F (fp32 and
bf16), else the GEMM formulation measured fastest on this machine, for this model's weights, at each row
count.

specd's kernel (`kernels.packed_linear`) packs each weight once into blocks of 16 outputs side by side and
streams it once per call, front to back, for every row of the call; each output is one sum over the inputs
in a fixed order, so a row's result is the same bits whatever the row count: batch invariant in fp32 as in
bf16. On a 2-core Xeon without AVX512-BF16 (2 threads, the default model's 30 layers, weights streamed
from memory, ms per call of M rows):

  M                                 1     4     8    16    64   256
  fp32         oneDNN (best torch) 41    53    57    65   127   311
               specd packed        23    23    27    34    89   266
  bf16         oneDNN packed       24    44    81    98   295  1000
               specd (widened)     13    15    22    31    97   327

Which torch fp32 formulation is fastest depends on the row count M (the step's new tokens), the thread
count and the CPU, by up to 4x, so no fixed table is right everywhere. Two machines of this project,
2 threads, ms per forward of the default model's 30 layers:

  M                                 1     8    32   128
  AMD EPYC     F.linear            52    67   113     —
               transposed          23    54   109     —
               oneDNN              32    57    97     —
  Intel Xeon   F.linear           8.7  20.1  33.7  85.6
  (AMX)        transposed        19.2  19.7  29.9 112.2
               oneDNN            13.2  21.4  40.1  97.1

Without AVX512F the engine measures the formulations once at start (`LinearPlan.measure`, under 1 s) and
keeps the fastest per row-count bucket. "transposed" is MKL's GEMM with the few rows as its small n side,
(weight @ x^T)^T.

In bf16 on CPUs with AMX or AVX512-BF16 the engine packs each weight once into the layout both read
and runs its own kernel (`kernels.packed_linear`): each output row is its own chain of tile products
(AMX) or dot products (AVX512-BF16) in a fixed order, so it is bit-identical whatever the row count,
and a decode step streams the weights at close to the memory bandwidth. Where dot products issue slowly
and two fp32 FMAs round exactly as one of them (`kernels.cpu.linear_products`), calls of 8 rows and
more take the FMAs: on a Xeon without AMX, forwards of 16 tokens at batch 1 1.2x faster, of 32
sequences' decodes 1.26x, of 32 x 4 tokens 1.4x, the same bits. Measured on the Xeon, the 30
layers and the vocab projection with weights streamed from memory: 8.4 ms at M = 1 (oneDNN packed
21.7), 11.0 ms at M = 26 (18.5), 26 ms at M = 128 (37). On an AMD EPYC (Zen 4, no AMX) whole forwards
of 1 and 32 sequences take about what oneDNN took (`benchmarks/step_cost.py`), and unlike oneDNN there
the rows are independent: with oneDNN the real model's bf16 logits were not batch invariant. With AVX512F
alone the kernel widens the bf16 weights to fp32 as they stream by and takes the FMAs.

Elsewhere in bf16 and fp16 the engine packs each weight once for oneDNN with a one-row hint. Its rows
were bit-identical whatever the row count up to 128 rows; above that the 1536-wide down projection
gave rows that depended on the count (at 150, 200 and 256 rows), so with oneDNN the forward keeps
larger calls to a single prompt's prefill (see `PagedAttention.matmul_rows`): the matmuls never make
a row depend on the batch.
"""
from __future__ import annotations

import bisect
import functools
import logging
import os
import time
from typing import Callable

import torch
import torch.nn.functional as F

import kernels

log = logging.getLogger(__name__)

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# Plans hold one choice per bucket; a row count goes to the smallest bucket at least as large.
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_SHARED_ROWS = 128  # rows of different sequences per matmul call: what `rows_independent` checks
# oneDNN and ideep (torch's layer over it) each cache one primitive per call shape, 1,024 by default, and an
# entry holds a buffer of the call's input besides (~0.3 MB + rows x K x 4 bytes on this project's AMD EPYC).
# A server's steps go through every row count up to its token budget, so at that default the two grew the
# target by hundreds of MB over a 10-minute soak. 32 shapes hold a step's (a few weight shapes for every
# layer); a miss costs ~0.4 ms once per weight shape per step, which did not show in 138 ms steps of 40
# row counts in turn (benchmarks/onednn_cache.py).
ONEDNN_CACHE_SHAPES = 32


def shared_runs(start: int, stop: int) -> list[slice]:
    """Rows start..stop-1 in slices of at most MAX_SHARED_ROWS."""
    return [slice(first, min(first + MAX_SHARED_ROWS, stop)) for first in range(start, stop, MAX_SHARED_ROWS)]


def transposed_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T computed as (weight @ x^T)^T, rows padded to a power of two of at least 2
    (n = 1 drops MKL to a slow GEMV)."""
    rows = x.shape[0]
    padded = max(2, 1 << max(rows - 1, 0).bit_length())
    x_pad = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])]) if padded > rows else x  # [p, K]
    return torch.mm(weight, x_pad.t()).t()[:rows].contiguous()


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T by oneDNN: a private op (the one torch.compile's CPU backend emits)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def bound_onednn_caches(shapes: int = ONEDNN_CACHE_SHAPES) -> None:
    """Caps oneDNN's primitive cache and ideep's at `shapes` entries each, unless the environment sets them.
    Both read their capacity once, on the first oneDNN call of the process: this must run before it."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(shapes))
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(shapes))


@functools.cache
def onednn_available() -> bool:
    """Whether this torch build runs `onednn_linear`; probed once, on the first call (never at import),
    which is this module's first oneDNN call: its caches are bounded first."""
    bound_onednn_caches()
    try:
        onednn_linear(torch.ones(9, 2), torch.ones(3, 2))
    except (AttributeError, RuntimeError):
        return False
    return True


def formulations() -> dict[str, Linear]:
    """Every way this torch build can compute x @ weight^T on CPU."""
    found = {"F.linear": F.linear, "transposed": transposed_linear}
    if onednn_available():
        found["oneDNN"] = onednn_linear
    return found


PACKED = "oneDNN packed"
SPECD_PACKED = "specd packed"  # kernels.packed_linear: bf16 by AMX tiles, AVX512-BF16 dot products or widened
# FMAs; fp32 by FMAs


def pack_for_onednn(weight: torch.Tensor) -> torch.Tensor:
    """The weight in oneDNN's blocked layout, tuned for one row at a time (rows stay independent)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1)


class LinearPlan:
    """x @ weight^T by one chosen formulation per row-count bucket (ROW_BUCKETS). Weights go through
    `prepare` once before use (a packed plan packs them)."""

    def __init__(self, names: tuple[str, ...]):
        available = {**formulations(), PACKED: onednn_linear, SPECD_PACKED: kernels.packed_linear}
        self.names = names
        self._choices = tuple(available[name] for name in names)
        # Whether a row's result is the same in a call of any row count (by construction), so that
        # `by_rows` need not split: specd's packed kernel's rows are.
        self.any_row_count = names[0] == SPECD_PACKED

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        if self.names[0] == SPECD_PACKED:
            return kernels.pack_linear_weight(weight)
        return pack_for_onednn(weight) if self.names[0] == PACKED else weight

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [M, K], weight [N, K] -> [M, N]."""
        bucket = min(bisect.bisect_left(ROW_BUCKETS, x.shape[0]), len(ROW_BUCKETS) - 1)
        return self._choices[bucket](x, weight)

    def by_rows(self, x: torch.Tensor, weight: torch.Tensor, rows: list[slice]) -> torch.Tensor:
        """self(x, weight), one call per slice of rows (covering x in order) unless any row count will do."""
        if self.any_row_count:
            return self._choices[0](x, weight)  # one formulation for every row count
        if len(rows) == 1:
            return self(x, weight)
        if not rows:  # no row wants logits: a step of prompt chunks with more to come
            return x.new_empty(0, weight.shape[0])
        return torch.cat([self(x[r], weight) for r in rows])

    @classmethod
    def torch_default(cls) -> LinearPlan:
        return cls(("F.linear",) * len(ROW_BUCKETS))

    @classmethod
    def measure(cls, weights: list[torch.Tensor], repeats: int = 3) -> LinearPlan:
        """On CPU: specd's packed kernel where it takes every one of `weights` (fp32 or bf16 on a CPU with
        AVX512F). Else for fp32 weights, per bucket, the formulation fastest over `weights` (say, one
        layer's); bf16 and fp16, packed for oneDNN where it runs them. Elsewhere F.linear."""
        if weights[0].device.type != "cpu":
            return cls.torch_default()
        if all(kernels.packs_linear_weight(w) for w in weights):
            return cls((SPECD_PACKED,) * len(ROW_BUCKETS))
        if weights[0].dtype != torch.float32:
            return cls((PACKED,) * len(ROW_BUCKETS)) if _packing_works(weights[0]) else cls.torch_default()
        started, names = time.perf_counter(), []
        for rows in ROW_BUCKETS:
            inputs = [torch.randn(rows, w.shape[1]) for w in weights]
            seconds = {name: _best_of(repeats, fn, inputs, weights) for name, fn in formulations().items()}
            names.append(min(seconds, key=seconds.get))
        plan = cls(tuple(names))
        log.info("matmul plan, measured in %.1f s: %s", time.perf_counter() - started, plan.describe())
        return plan

    def rows_independent(self, prepared: list[torch.Tensor]) -> bool:
        """Whether, for these weights (as `prepare` returned them), each output row is bit-identical
        whatever the row count (up to MAX_SHARED_ROWS, or past the packed kernel's 256-row passes for a
        plan whose calls may take any count): what batch-invariant decoding needs of the matmuls.
        Checked, not assumed: it depends on the kernels the CPU and the library pick (oneDNN's bf16
        kernels passed on an AMX Xeon and failed on an AMD EPYC, its fp16 ones fail at K = 1536, no fp32
        formulation passes)."""
        generator = torch.Generator(device=prepared[0].device).manual_seed(0)
        largest = 300 if self.any_row_count else MAX_SHARED_ROWS
        for weight in prepared:
            x = torch.randn(largest, _input_size(weight), generator=generator, device=weight.device)
            x = x.to(weight.dtype)
            alone = {row: self(x[row:row + 1], weight) for row in (0, 1, 2, 7, 16, 63, largest - 1)}
            for count in (2, 3, 8, 17, 64, MAX_SHARED_ROWS, largest):
                out = self(x[:count], weight)
                if not all(torch.equal(out[row:row + 1], expected) for row, expected in alone.items() if row < count):
                    return False
        return True

    def describe(self) -> str:
        return ", ".join(f"{rows} rows {name}" for rows, name in zip(ROW_BUCKETS, self.names))


def _input_size(prepared: torch.Tensor) -> int:
    """K of a weight as `LinearPlan.prepare` returned it: [N, K], or packed: bf16 [N / 16, K / 32, 16, 32],
    fp32 [N / 16, K, 16]."""
    return prepared.shape[1] * 32 if prepared.dim() == 4 else prepared.shape[1]


def _packing_works(weight: torch.Tensor) -> bool:
    if not onednn_available():
        return False
    try:
        onednn_linear(weight.new_ones(1, weight.shape[1]), pack_for_onednn(weight[:4]))
    except RuntimeError:
        return False
    return True


def _best_of(repeats: int, fn: Linear, inputs: list[torch.Tensor], weights: list[torch.Tensor]) -> float:
    fn(inputs[0], weights[0])  # warm-up: first calls pay for allocation and dispatch
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for x, w in zip(inputs, weights):
            fn(x, w)
        best = min(best, time.perf_counter() - started)
    return best
