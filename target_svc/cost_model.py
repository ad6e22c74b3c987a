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
import threading
import time
from dataclasses import dataclass

import torch

from target_svc.engine.runner import ModelRunner, SequenceInput


@dataclass(frozen=True)
class StepShape:
    tokens: int  # new tokens in the forward: prompt chunks, decodes' newest tokens, drafts
    context: int  # the lengths the step's sequences reach (cached + new tokens), summed

    def features(self) -> torch.Tensor:
        return torch.tensor([1.0, self.tokens, self.context], dtype=torch.float64)


# Before any measurement: a 20 ms one-token step, each more token 12% of that (specd's old constant),
# weighing a thousandth of one measured step, so that the first measurements decide.
_PRIOR_WEIGHT = 1e-3
_PRIOR = [(StepShape(1, 1), 0.020), (StepShape(65, 65), 0.020 * (1 + 0.12 * 64)), (StepShape(1, 4096), 0.022)]


class StepCostModel:
    def __init__(self, decay: float = 0.98, ridge: float = 1e-9):
        self._decay, self._ridge = decay, ridge
        self._lock = threading.Lock()  # observed on the compute thread, asked on the event loop
        # The least squares' statistics (xᵀx, xᵀy): the profile's, kept, and the steps', decayed.
        self._fixed = (torch.zeros(3, 3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64))
        self._online = (torch.zeros(3, 3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64))
        for shape, seconds in _PRIOR:
            self._add(shape, seconds, fixed=True, weight=_PRIOR_WEIGHT)
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
        with self._lock:
            if profile and self._prior:
                self._fixed[0].zero_(), self._fixed[1].zero_()
                self._prior = False
            if not profile:
                self._online[0].mul_(self._decay), self._online[1].mul_(self._decay)
            self._add(shape, seconds, fixed=profile)
            self._coefficients = self._solve()

    def _add(self, shape: StepShape, seconds: float, fixed: bool, weight: float = 1.0) -> None:
        x = shape.features()
        xtx, xty = self._fixed if fixed else self._online
        xtx.add_(weight * torch.outer(x, x))
        xty.add_(weight * seconds * x)

    def _solve(self) -> tuple[float, float, float]:
        """Non-negative least squares (a step never gets cheaper with more work, and noise must not make
        drafts look free): the best fit over the subsets of terms whose coefficients all come out
        non-negative, the rest held at zero. With three terms that is seven small solves."""
        xtx = self._fixed[0] + self._online[0] + self._ridge * torch.eye(3, dtype=torch.float64)
        xty = self._fixed[1] + self._online[1]
        best, best_error = torch.zeros(3, dtype=torch.float64), float("inf")
        for size in (1, 2, 3):
            for terms in itertools.combinations(range(3), size):
                index = list(terms)
                coefficients = torch.zeros(3, dtype=torch.float64)
                coefficients[index] = torch.linalg.solve(xtx[index][:, index], xty[index])
                if (coefficients < 0).any():
                    continue
                error = float(coefficients @ xtx @ coefficients - 2 * coefficients @ xty)  # the squares, less yᵀy
                if error < best_error:
                    best, best_error = coefficients, error
        fixed, per_token, per_context = best.tolist()
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


def _timed(runner: ModelRunner, batch: list[SequenceInput]) -> float:
    started = time.perf_counter()
    runner.forward(batch)
    return time.perf_counter() - started
