"""What one target step costs, measured where it runs.

seconds ≈ fixed + per_token · new tokens + per_context · the step's sequences' lengths, summed

(the length a sequence reaches in the step is what its queries attend over: its cached tokens and
its new ones),

fitted by least squares to a short profile at start-up and then to every real step, recent steps
weighing more (the profile keeps its weight, so the fit stays determined when the load is steady).
The scheduler asks it what verifying more draft tokens would cost and keeps the drafts that raise
the batch's tokens out per second (`choose_drafts`).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from target_svc.engine.runner import ModelRunner, SequenceInput

TERMS = 3  # fixed, per new token, per token of the sequences' lengths


@dataclass(frozen=True)
class StepShape:
    tokens: int  # new tokens in the forward: prompt chunks, decodes' newest tokens, drafts
    context: int  # the lengths the step's sequences reach (cached + new tokens), summed

    def features(self) -> tuple[float, float, float]:
        return 1.0, float(self.tokens), float(self.context)


# Before any measurement: a 20 ms one-token step, each more token 12% of that (specd's old constant),
# weighing a thousandth of one measured step, so that the first measurements decide.
_PRIOR_WEIGHT = 1e-3
_PRIOR = [(StepShape(1, 1), 0.020), (StepShape(65, 65), 0.020 * (1 + 0.12 * 64)), (StepShape(1, 4096), 0.022)]


class _Moments:
    """The least squares' sufficient statistics xᵀx and xᵀy, in plain floats: a step's update and fit
    cost microseconds on the compute thread (torch's small-tensor calls cost ~0.4 ms a step)."""

    def __init__(self) -> None:
        self.xtx = [[0.0] * TERMS for _ in range(TERMS)]
        self.xty = [0.0] * TERMS

    def add(self, shape: StepShape, seconds: float, weight: float = 1.0) -> None:
        x = shape.features()
        for i in range(TERMS):
            self.xty[i] += weight * seconds * x[i]
            for j in range(TERMS):
                self.xtx[i][j] += weight * x[i] * x[j]

    def scale(self, factor: float) -> None:
        self.xty = [v * factor for v in self.xty]
        self.xtx = [[v * factor for v in row] for row in self.xtx]


class StepCostModel:
    """Observed on the compute thread only; the event loop reads `coefficients`, a tuple replaced whole."""

    def __init__(self, decay: float = 0.98, ridge: float = 1e-9):
        self._decay, self._ridge = decay, ridge
        self._fixed, self._online = _Moments(), _Moments()  # the profile's, kept; the steps', decayed
        for shape, seconds in _PRIOR:
            self._fixed.add(shape, seconds, _PRIOR_WEIGHT)
        self._prior = True
        self._coefficients = self._solve()

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """Seconds: fixed, per new token, per token of the sequences' lengths."""
        return self._coefficients

    def predict(self, shape: StepShape) -> float:
        fixed, per_token, per_context = self._coefficients
        return fixed + per_token * shape.tokens + per_context * shape.context

    def observe(self, shape: StepShape, seconds: float, profile: bool = False) -> None:
        """A measured step; `profile` steps keep their weight for good (the first one replaces the prior)."""
        if profile and self._prior:
            self._fixed, self._prior = _Moments(), False
        if not profile:
            self._online.scale(self._decay)
        (self._fixed if profile else self._online).add(shape, seconds)
        self._coefficients = self._solve()

    def _solve(self) -> tuple[float, float, float]:
        """Non-negative least squares (a step never gets cheaper with more work, and noise must not make
        drafts look free): the best fit over the subsets of terms whose coefficients all come out
        non-negative, the rest held at zero. With three terms that is seven small solves."""
        xtx = [[f + o + (self._ridge if i == j else 0.0) for j, (f, o) in enumerate(zip(fr, orow))]
               for i, (fr, orow) in enumerate(zip(self._fixed.xtx, self._online.xtx))]
        xty = [f + o for f, o in zip(self._fixed.xty, self._online.xty)]
        best, best_error = [0.0] * TERMS, float("inf")
        for size in range(1, TERMS + 1):
            for terms in itertools.combinations(range(TERMS), size):
                solved = _solve_linear([[xtx[i][j] for j in terms] for i in terms], [xty[i] for i in terms])
                if solved is None or min(solved) < 0:
                    continue
                coefficients = [0.0] * TERMS
                for i, value in zip(terms, solved):
                    coefficients[i] = value
                # The squared error, less yᵀy (the same for every subset): cᵀ(xᵀx)c - 2cᵀ(xᵀy).
                error = sum(coefficients[i] * xtx[i][j] * coefficients[j] for i in range(TERMS) for j in range(TERMS)) \
                    - 2 * sum(c * y for c, y in zip(coefficients, xty))
                if error < best_error:
                    best, best_error = coefficients, error
        fixed, per_token, per_context = best
        return fixed, max(per_token, 1e-7), per_context

    def profile(self, runner: ModelRunner) -> None:
        """A few forwards of throwaway sequences at start: steps of 1 to 32 new tokens on one short
        sequence, eight short ones and eight long ones, sized to the KV cache. Batches of eight measure the
        length term as a batch pays it (one sequence alone uses the threads less well). Run on the
        compute thread."""
        allocator = runner.allocator
        for num_seqs, longest in ((1, 16), (8, 32), (8, 256)):
            # Each sequence's prompt plus 32 new tokens, a block to spare, must fit the cache.
            context = min(longest, allocator.num_blocks // num_seqs * allocator.block_size - 32 - allocator.block_size)
            if context < 1:
                continue
            ids = [f"cost-profile-{i}" for i in range(num_seqs)]
            try:
                prompts = [SequenceInput(i, [1] * context, 0, 1) for i in ids]
                runner.forward(prompts)  # not observed: a prompt's attention grows with its square
                for new in (1, 4, 16, 32):
                    steps = [SequenceInput(i, [1] * new, context, new) for i in ids]
                    self.observe(StepShape(num_seqs * new, num_seqs * (context + new)), _timed(runner, steps),
                                 profile=True)
                    for i in ids:
                        allocator.truncate(i, context)
            finally:
                for i in ids:
                    allocator.free(i)


def _solve_linear(a: list[list[float]], b: list[float]) -> list[float] | None:
    """a x = b by Gaussian elimination with partial pivoting (n <= 3); None where a is singular."""
    n = len(b)
    rows = [list(row) + [value] for row, value in zip(a, b)]
    for column in range(n):
        pivot = max(range(column, n), key=lambda r: abs(rows[r][column]))
        if rows[pivot][column] == 0.0:
            return None
        rows[column], rows[pivot] = rows[pivot], rows[column]
        for r in range(column + 1, n):
            factor = rows[r][column] / rows[column][column]
            rows[r] = [x - factor * y for x, y in zip(rows[r], rows[column])]
    solution = [0.0] * n
    for r in reversed(range(n)):
        solution[r] = (rows[r][n] - sum(rows[r][c] * solution[c] for c in range(r + 1, n))) / rows[r][r]
    return solution


def _timed(runner: ModelRunner, batch: list[SequenceInput]) -> float:
    started = time.perf_counter()
    runner.forward(batch)
    return time.perf_counter() - started
