"""What one target step costs, measured where it runs.

seconds ≈ fixed + per_token · new tokens + per_context · the step's sequences' lengths, summed
                + per_pair · the step's query-key pairs

(the length a sequence reaches in the step is the K/V its attention reads; each new token attends
over the tokens up to itself, so a prompt chunk of n tokens after d cached ones brings n·d + n(n+1)/2
pairs: a chunk deep in a long prompt costs many times one at its start, measured on a 2-core EPYC
at 16 ms against 560 ms for 32 tokens after 0 and after 7,936),

fitted by least squares to a short profile at start-up and then to every real step, recent steps
weighing more (the profile keeps its weight, so the fit stays determined when the load is steady).
The scheduler asks it what verifying more draft tokens would cost and keeps the drafts that raise
the batch's tokens out per second (`choose_drafts`).
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import Iterable, NamedTuple

from engine.runner import ModelRunner, SequenceInput

class Coefficients(NamedTuple):
    """Seconds: per step, per new token, per token of the sequences' lengths, per query-key pair."""
    fixed: float
    per_token: float
    per_context: float
    per_pair: float


TERMS = len(Coefficients._fields)


@dataclass(frozen=True)
class StepShape:
    tokens: int  # new tokens in the forward: prompt chunks, decodes' newest tokens, drafts
    context: int  # the lengths the step's sequences reach (cached + new tokens), summed
    pairs: int  # the query-key pairs of the step's attention

    @classmethod
    def of(cls, spans: Iterable[tuple[int, int]]) -> StepShape:
        """The shape of a step whose sequences each bring (cached tokens, new tokens)."""
        tokens = context = pairs = 0
        for cached, new in spans:
            tokens, context, pairs = tokens + new, context + cached + new, pairs + attention_pairs(cached, new)
        return cls(tokens, context, pairs)

    def features(self) -> tuple[float, ...]:
        return 1.0, float(self.tokens), float(self.context), float(self.pairs)


def attention_pairs(cached: int, new: int) -> int:
    """Query-key pairs of `new` tokens after `cached` ones: each attends over the tokens up to itself."""
    return new * cached + new * (new + 1) // 2


# Before any measurement: a 20 ms one-token step, each more token 12% of that (specd's old constant),
# weighing a thousandth of one measured step, so that the first measurements decide.
_PRIOR_WEIGHT = 1e-3
_PRIOR = [(StepShape.of([(0, 1)]), 0.020), (StepShape.of([(0, 65)]), 0.020 * (1 + 0.12 * 64)),
          (StepShape.of([(4095, 1)]), 0.022), (StepShape.of([(4032, 64)]), 0.020 * (1 + 0.12 * 64) + 0.01)]


PROFILE_NEW_TOKENS = (1, 4, 16, 32, 64)
# Each profile step is timed this many times and the fastest kept: a neighbour's burst on a shared
# machine must not teach the model, for good, that drafts cost what decodes do.
PROFILE_REPEATS = 3


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
    def coefficients(self) -> Coefficients:
        return self._coefficients

    def predict(self, shape: StepShape) -> float:
        return sum(c * x for c, x in zip(self._coefficients, shape.features()))

    def token_seconds(self, position: int) -> float:
        """What one more new token at `position` (0-based, in its sequence) adds to a step."""
        c = self._coefficients
        return c.per_token + c.per_context + c.per_pair * (position + 1)

    def chunk_seconds(self, cached: int, new: int) -> float:
        """What `new` tokens of a sequence after `cached` ones add to a step."""
        c = self._coefficients
        return c.per_token * new + c.per_context * (cached + new) + c.per_pair * attention_pairs(cached, new)

    def tokens_within(self, seconds: float, cached: int) -> int:
        """The most new tokens after `cached` ones whose `chunk_seconds` fit in `seconds`."""
        c = self._coefficients
        # per_pair/2 · n² + (per_token + per_context + per_pair · (cached + 1/2)) · n + per_context · cached ≤ seconds
        a, b = c.per_pair / 2, c.per_token + c.per_context + c.per_pair * (cached + 0.5)
        room = seconds - c.per_context * cached
        if room <= 0:
            return 0
        n = room / b if a == 0 else (math.sqrt(b * b + 4 * a * room) - b) / (2 * a)
        return int(n + 1e-9)

    def observe(self, shape: StepShape, seconds: float, profile: bool = False) -> None:
        """A measured step; `profile` steps keep their weight for good (the first one replaces the prior)."""
        if profile and self._prior:
            self._fixed, self._prior = _Moments(), False
        if not profile:
            self._online.scale(self._decay)
        (self._fixed if profile else self._online).add(shape, seconds)
        self._coefficients = self._solve()

    def _solve(self) -> Coefficients:
        """Non-negative least squares (a step never gets cheaper with more work, and noise must not make
        drafts look free): the best fit over the subsets of terms whose coefficients all come out
        non-negative, the rest held at zero (fifteen small solves with four terms). It runs after every
        step, so the unconstrained fit, the answer whenever it is non-negative, goes first."""
        xtx = [[f + o + (self._ridge if i == j else 0.0) for j, (f, o) in enumerate(zip(fr, orow))]
               for i, (fr, orow) in enumerate(zip(self._fixed.xtx, self._online.xtx))]
        xty = [f + o for f, o in zip(self._fixed.xty, self._online.xty)]
        unconstrained = _solve_linear(xtx, xty)
        if unconstrained is not None and min(unconstrained) >= 0:
            return _coefficients(unconstrained)
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
        return _coefficients(best)

    def profile(self, runner: ModelRunner) -> None:
        """A few forwards of throwaway sequences at start: steps of 1 to 64 new tokens on one short
        sequence, eight short ones and eight long ones, sized to the KV cache. Batches of eight measure the
        length term as a batch pays it (one sequence alone uses the threads less well); 1 to 64 new tokens
        on the same lengths tell the lengths' term from the pairs'. Run on the compute thread."""
        allocator = runner.allocator
        for num_seqs, longest in ((1, 16), (8, 32), (8, 256)):
            # Each sequence's prompt plus the most new tokens, a block to spare, must fit the cache.
            room = allocator.num_blocks // num_seqs * allocator.block_size - allocator.block_size
            context = min(longest, room - PROFILE_NEW_TOKENS[-1])
            if context < 1:
                continue
            ids = [f"cost-profile-{i}" for i in range(num_seqs)]
            try:
                prompts = [SequenceInput(i, [1] * context, 0, 1) for i in ids]
                runner.forward(prompts)  # not observed: a prompt's attention grows with its square
                # The sizes in turn, PROFILE_REPEATS times over: a burst of other work disturbs one round, not
                # every timing of one size.
                fastest = dict.fromkeys(PROFILE_NEW_TOKENS, math.inf)
                for _ in range(PROFILE_REPEATS):
                    for new in PROFILE_NEW_TOKENS:
                        steps = [SequenceInput(i, [1] * new, context, new) for i in ids]
                        fastest[new] = min(fastest[new], _timed(runner, steps, ids, context))
                for new, seconds in fastest.items():
                    self.observe(StepShape.of([(context, new)] * num_seqs), seconds, profile=True)
            finally:
                for i in ids:
                    allocator.free(i)


def _coefficients(fitted: list[float]) -> Coefficients:
    """The fit as named terms; a new token is never quite free (the draft choice divides by its cost)."""
    fixed, per_token, per_context, per_pair = fitted
    return Coefficients(fixed, max(per_token, 1e-7), per_context, per_pair)


def _solve_linear(a: list[list[float]], b: list[float]) -> list[float] | None:
    """a x = b by Gaussian elimination with partial pivoting (n <= 4); None where a is singular."""
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


def _timed(runner: ModelRunner, batch: list[SequenceInput], ids: list[str], context: int) -> float:
    """Seconds of one forward of `batch`, whose sequences are then cut back to `context` tokens."""
    started = time.perf_counter()
    runner.forward(batch)
    seconds = time.perf_counter() - started
    for i in ids:
        runner.allocator.truncate(i, context)
    return seconds
