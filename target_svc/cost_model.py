"""What one target step costs, measured where it runs.

seconds ≈ fixed + per_token · new tokens + per_token_past_first_knee · new tokens past the first knee
                + per_token_past_second_knee · new tokens past the second knee
                + per_context · the step's sequences' lengths, summed + per_pair · the step's query-key pairs

A forward reads every weight once whatever its rows, so its first few new tokens ride nearly free, and
past some count, the first knee, each costs its full arithmetic: on a 2-core EPYC in bf16 one short
sequence's step took 9.3 ms for 1 new token, 10.2 ms for 4, 13.6 ms for 8 and then ~0.8 ms a token,
and past ~128 tokens (the second knee: activations outgrow the caches) ~0.9 ms. A straight line through
that prices a batch-1 step's first draft tokens at twice their cost and the step itself a sixth under
it. The knees are the two of KNEES, or one, or none, that fit the start-up profile best. A small step's
next token is priced at what the profile measured it to add (`small_steps`): the matrix products change
kernels at some row counts, and no knee fits a jump.

The length a sequence reaches in the step is the K/V its attention reads; each new token attends over
the tokens up to itself, so a prompt chunk of n tokens after d cached ones brings n·d + n(n+1)/2 pairs:
a chunk deep in a long prompt costs many times one at its start (measured on a 2-core EPYC at 16 ms
against 560 ms for 32 tokens after 0 and after 7,936).

The terms are fitted by non-negative least squares to a short profile at start-up and then to every
real step, recent steps weighing more (the profile keeps its weight, so the fit stays determined when
the load is steady): that fit says how long steps take (the prefill budget, the drafters' gates, the
predicted seconds exported). Draft tokens are priced against decodes by the profile's fit alone
(`quiet`): the target on its own cores. Under load the gateway's, the clients' and the drafters' work
for each stream runs beside every forward, and fitted online it went to the terms that grow with the
step's sequences: a decode looked 1.4 times as dear as in the profile and a draft token as dear as
there, so the batch verified drafts that did not pay (at 42 decodes the online fit kept draft tokens
from a 42% chance of acceptance, the profile's from 60%; a forward of 40 decodes alone measured 138 ms,
each draft token beside them 1.5 ms, so 66% breaks even with the margin). That work comes with the
tokens streamed, whether a decode or an accepted draft token brought them, or slows the forward as a
whole; either way the ratio of a draft token's price to a decode's is the quiet one.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, NamedTuple

from engine.runner import ModelRunner, SequenceInput


class Coefficients(NamedTuple):
    """Seconds: per step, per new token, per new token past each knee, per token of the sequences' lengths,
    per query-key pair."""
    fixed: float
    per_token: float
    per_token_past_first_knee: float
    per_token_past_second_knee: float
    per_context: float
    per_pair: float


TERMS = len(Coefficients._fields)
# Where a knee may be, in a step's new tokens.
KNEES = (2, 4, 8, 16, 32, 64, 128, 256, 512)
Knees = tuple[int, ...]  # ascending, at most two


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


@dataclass(frozen=True)
class Fit:
    """One fit of the terms, and the knees they bend at; and the measured seconds of small steps
    (`StepCostModel.small_steps`), which price their next token where they reach."""
    knees: Knees
    coefficients: Coefficients
    small_steps: tuple[float, ...] = ()

    def predict(self, shape: StepShape) -> float:
        return sum(c * x for c, x in zip(self.coefficients, features(shape, self.knees)))

    def token_seconds(self, position: int, step_tokens: int) -> float:
        """What one more new token at `position` (0-based, in its sequence) adds to a step that has
        `step_tokens` new tokens already."""
        c = self.coefficients
        if 0 < step_tokens < len(self.small_steps):
            slope = self.small_steps[step_tokens] - self.small_steps[step_tokens - 1]
        else:
            past = (c.per_token_past_first_knee, c.per_token_past_second_knee)
            slope = c.per_token + sum(extra for knee, extra in zip(self.knees, past) if step_tokens >= knee)
        return slope + c.per_context + c.per_pair * (position + 1)

    def token_prices(self, positions: Iterable[int], step_tokens: int) -> list[float]:
        """What each new token at `positions`, added in turn to a step that has `step_tokens` new tokens,
        adds to it: each at the step's size so far, the earlier ones counted (past the knees and the small
        steps' jumps they carry the step to)."""
        return [self.token_seconds(position, step_tokens + count) for count, position in enumerate(positions)]


def attention_pairs(cached: int, new: int) -> int:
    """Query-key pairs of `new` tokens after `cached` ones: each attends over the tokens up to itself."""
    return new * cached + new * (new + 1) // 2


def features(shape: StepShape, knees: Knees) -> tuple[float, ...]:
    """What each coefficient multiplies in a step of `shape` (a missing knee's term multiplies nothing)."""
    past = [float(max(0, shape.tokens - knee)) for knee in knees] + [0.0] * (2 - len(knees))
    return 1.0, float(shape.tokens), *past, float(shape.context), float(shape.pairs)


# Before any measurement: a 20 ms one-token step, each more token 12% of that (specd's old constant),
# weighing a thousandth of one measured step, so that the first measurements decide.
_PRIOR_WEIGHT = 1e-3
_PRIOR = [(StepShape.of([(0, 1)]), 0.020), (StepShape.of([(0, 65)]), 0.020 * (1 + 0.12 * 64)),
          (StepShape.of([(4095, 1)]), 0.022), (StepShape.of([(4032, 64)]), 0.020 * (1 + 0.12 * 64) + 0.01)]


PROFILE_NEW_TOKENS = (1, 2, 4, 8, 16, 32, 64)
# Each profile step is timed this many times and the fastest kept: a neighbour's burst on a shared
# machine must not teach the model, for good, that drafts cost what decodes do.
PROFILE_REPEATS = 3
# And a step of up to SMALL_STEP_TOKENS new tokens this many times: these decide the price of a batch-1
# step's first draft tokens, from differences of a few tenths of a millisecond in ~12 ms. Timed the fastest
# of 3, four profiles of the default model in one quiet process priced the first new token from 0.0 to
# 0.87 ms (bf16, 2 threads, a 2-core Xeon), and targets of one bench run from 0.1 to 1.3 ms: the stack
# with the dearest drafted a third fewer tokens a step than the others. The fastest of 9 costs ~0.3 s.
# One short sequence's step is timed at every count up to SMALL_STEP_TOKENS (`small_steps`): the matrix
# products change kernels at some row counts, and a step's cost jumps there. On a 2-core Xeon in fp32,
# batch-1 steps of Spec-Bench took 27.0-29.1 ms for 1 to 6 new tokens, 33.0 ms for 7 and 35.4 ms for 9:
# fitted with knees, a draft's 6th token was priced at 1 ms like its 2nd, and drafts of 8 tokens, whose
# last three were accepted a tenth of the time (trie, lookahead, fused), ran in a third of the steps.
SMALL_STEP_TOKENS = 16
SMALL_STEP_REPEATS = 9
# The larger steps' repeats past the first round, only while a batch shape's rounds have taken less than
# this: in bf16 on an AVX2-only CPU a new token cost ~11 ms and the whole profile took two to five minutes,
# where one round of such slow steps already stands well above the noise the repeats guard against.
REPEAT_WITHIN_SECONDS = 10.0


class _Moments:
    """The least squares' sufficient statistics xᵀx and xᵀy, in plain floats: a step's update and fit
    cost microseconds on the compute thread (torch's small-tensor calls cost ~0.4 ms a step)."""

    def __init__(self) -> None:
        self.xtx = [[0.0] * TERMS for _ in range(TERMS)]
        self.xty = [0.0] * TERMS

    def add(self, x: tuple[float, ...], seconds: float, weight: float = 1.0) -> None:
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
        self.knees: Knees = ()
        self._profiled: list[tuple[StepShape, float]] = []  # kept to place the knees as profile steps arrive
        self._fixed, self._online = _Moments(), _Moments()  # the profile's (or the prior's), kept; the steps', decayed
        for shape, seconds in _PRIOR:
            self._fixed.add(features(shape, self.knees), seconds, _PRIOR_WEIGHT)
        # Seconds of one short sequence's step of 1, 2, ... SMALL_STEP_TOKENS new tokens, as profiled
        # (made non-decreasing): where a step is that small, its next token costs the difference.
        self.small_steps: tuple[float, ...] = ()
        self._fit = Fit(self.knees, self._solve(self._fixed, self._online))
        self.quiet = self._fit  # the profile's fit alone (the prior's before it): what draft tokens are priced by

    @property
    def coefficients(self) -> Coefficients:
        return self._fit.coefficients

    def predict(self, shape: StepShape) -> float:
        return self._fit.predict(shape)

    def token_seconds(self, position: int, step_tokens: int) -> float:
        """What one more new token at `position` (0-based, in its sequence) adds to a step that has
        `step_tokens` new tokens already."""
        return self._fit.token_seconds(position, step_tokens)

    def chunk_seconds(self, cached: int, new: int) -> float:
        """What `new` tokens of a sequence after `cached` ones add to a step, priced past the knees (prompt
        chunks come in large pieces, and beside other work)."""
        c = self.coefficients
        return self._chunk_per_token * new + c.per_context * (cached + new) + c.per_pair * attention_pairs(cached, new)

    def tokens_within(self, seconds: float, cached: int) -> int:
        """The most new tokens after `cached` ones whose `chunk_seconds` fit in `seconds`."""
        c = self.coefficients
        # per_pair/2 · n² + (per token + per_context + per_pair · (cached + 1/2)) · n + per_context · cached ≤ seconds
        a, b = c.per_pair / 2, self._chunk_per_token + c.per_context + c.per_pair * (cached + 0.5)
        room = seconds - c.per_context * cached
        if room <= 0:
            return 0
        n = room / b if a == 0 else (math.sqrt(b * b + 4 * a * room) - b) / (2 * a)
        return int(n + 1e-9)

    @property
    def _chunk_per_token(self) -> float:
        c = self.coefficients
        return c.per_token + c.per_token_past_first_knee + c.per_token_past_second_knee

    def observe(self, shape: StepShape, seconds: float, profile: bool = False) -> None:
        """A measured step. `profile` steps keep their weight for good (the first one replaces the prior),
        and each one places the knees afresh."""
        if profile:
            self._profiled.append((shape, seconds))
            self.knees, self._fixed, fitted = self._best_knees()
            self._online = _Moments()  # the profile comes first; steps fitted on other knees would not add up
            self._fit = self.quiet = Fit(self.knees, fitted, self.small_steps)
            return
        self._online.scale(self._decay)
        self._online.add(features(shape, self.knees), seconds)
        self._fit = Fit(self.knees, self._solve(self._fixed, self._online), self.small_steps)

    def observe_small_steps(self, seconds: list[float]) -> None:
        """Measured seconds of one short sequence's steps of 1, 2, ... new tokens (`small_steps`)."""
        self.small_steps = _non_decreasing(seconds)
        self._fit = Fit(self._fit.knees, self._fit.coefficients, self.small_steps)
        self.quiet = Fit(self.quiet.knees, self.quiet.coefficients, self.small_steps)

    def _best_knees(self) -> tuple[Knees, _Moments, Coefficients]:
        """The knees (and their moments and fit) whose fit to the profile leaves the least squared relative
        error: none, one of KNEES, or two."""
        empty, best = _Moments(), None
        choices = [(), *((k,) for k in KNEES), *itertools.combinations(KNEES, 2)]  # fewer knees first
        for knees in choices:
            moments = _Moments()
            rows = [(features(shape, knees), seconds) for shape, seconds in self._profiled]
            for x, seconds in rows:
                moments.add(x, seconds)
            fitted = self._solve(moments, empty)
            # Relative errors: in absolute ones the longest steps would decide where the shortest bend.
            error = sum((sum(c * v for c, v in zip(fitted, x)) / seconds - 1) ** 2
                        for x, seconds in rows if seconds > 0)
            if best is None or error < 0.99 * best[0] - 1e-12:  # a knee must earn its place: ties keep fewer
                best = (error, knees, moments, fitted)
        return best[1], best[2], best[3]

    def _solve(self, fixed: _Moments, online: _Moments) -> Coefficients:
        """Non-negative least squares (a step never gets cheaper with more work, and noise must not make
        drafts look free), by Lawson and Hanson's active set on the normal equations: it runs after every
        step, and the unconstrained fit, the answer whenever it is non-negative, comes out first."""
        xtx = [[f + o + (self._ridge if i == j else 0.0) for j, (f, o) in enumerate(zip(fr, orow))]
               for i, (fr, orow) in enumerate(zip(fixed.xtx, online.xtx))]
        xty = [f + o for f, o in zip(fixed.xty, online.xty)]
        return _coefficients(_nnls(xtx, xty))

    def save_profile(self, path: str | Path, key: str) -> None:
        """The profile's measured steps, for targets of the same `key` (model, device, dtype, threads) to start
        from (`load_profile`): targets compared side by side then price drafts alike. Written whole or not at all."""
        path = Path(path)
        steps = [[shape.tokens, shape.context, shape.pairs, seconds] for shape, seconds in self._profiled]
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(json.dumps({"key": key, "steps": steps, "small_steps": list(self.small_steps)}))
        partial.replace(path)

    def load_profile(self, path: str | Path, key: str) -> bool:
        """Observes a saved profile's steps as this target's own, if `path` holds one of the same `key`."""
        try:
            saved = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            return False
        if not isinstance(saved, dict) or saved.get("key") != key or not saved.get("steps"):
            return False
        for tokens, context, pairs, seconds in saved["steps"]:
            self.observe(StepShape(int(tokens), int(context), int(pairs)), float(seconds), profile=True)
        self.observe_small_steps([float(seconds) for seconds in saved.get("small_steps", [])])
        return True

    def profile(self, runner: ModelRunner) -> None:
        """A few forwards of throwaway sequences at start: steps of 1 to 64 new tokens on one short
        sequence, eight short ones and eight long ones, sized to the KV cache. Batches of eight measure the
        length term as a batch pays it (one sequence alone uses the threads less well); 1 to 64 new tokens
        on the same lengths tell the lengths' term from the pairs'. The short sequence's steps are timed at
        every count up to SMALL_STEP_TOKENS besides (`small_steps`), the fit taking those of
        PROFILE_NEW_TOKENS like the others'. Run on the compute thread."""
        allocator = runner.allocator
        for num_seqs, longest in ((1, 16), (8, 32), (8, 256)):
            # Each sequence's prompt plus the most new tokens, a block to spare, must fit the cache.
            room = allocator.num_blocks // num_seqs * allocator.block_size - allocator.block_size
            context = min(longest, room - PROFILE_NEW_TOKENS[-1])
            if context < 1:
                continue
            ids = [f"cost-profile-{i}" for i in range(num_seqs)]
            counts = PROFILE_NEW_TOKENS
            if num_seqs == 1:
                counts = tuple(sorted({*PROFILE_NEW_TOKENS, *range(1, SMALL_STEP_TOKENS + 1)}))
            try:
                prompts = [SequenceInput(i, [1] * context, 0, 1) for i in ids]
                runner.forward(prompts)  # not observed: a prompt's attention grows with its square
                # The sizes in turn, round after round (`_repeat`): a burst of other work disturbs one round,
                # not every timing of one size.
                fastest, started = dict.fromkeys(counts, math.inf), time.perf_counter()
                for round_ in range(SMALL_STEP_REPEATS):
                    for new in counts:
                        if _repeat(round_, new * num_seqs, time.perf_counter() - started):
                            steps = [SequenceInput(i, [1] * new, context, new) for i in ids]
                            fastest[new] = min(fastest[new], _timed(runner, steps, ids, context))
                for new in PROFILE_NEW_TOKENS:
                    self.observe(StepShape.of([(context, new)] * num_seqs), fastest[new], profile=True)
                if num_seqs == 1:
                    self.observe_small_steps([fastest[new] for new in range(1, SMALL_STEP_TOKENS + 1)])
            finally:
                for i in ids:
                    allocator.free(i)


def _non_decreasing(values: list[float]) -> tuple[float, ...]:
    """The non-decreasing sequence nearest `values` in least squares (pooling adjacent violators): a step
    of more tokens never costs less, and a noisy timing must not make a token look free or dear."""
    blocks: list[tuple[float, int]] = []  # (mean, count), means ascending
    for value in values:
        mean, count = value, 1
        while blocks and blocks[-1][0] > mean:
            previous, before = blocks.pop()
            mean, count = (previous * before + mean * count) / (before + count), before + count
        blocks.append((mean, count))
    return tuple(mean for mean, count in blocks for _ in range(count))


def _coefficients(fitted: list[float]) -> Coefficients:
    """The fit as named terms; a new token is never quite free (the draft choice divides by its cost)."""
    fixed, per_token, *rest = fitted
    return Coefficients(fixed, max(per_token, 1e-7), *rest)


def _nnls(xtx: list[list[float]], xty: list[float], tolerance: float = 1e-15) -> list[float]:
    """x ≥ 0 minimising |Ax - y|² given AᵀA and Aᵀy (Lawson and Hanson): terms join the free set while
    the gradient says one would lower the error; a free term the fit pushes below zero steps back to the
    boundary and leaves it."""
    n = len(xty)
    x = [0.0] * n
    free: list[int] = []
    solved = _solve_linear(xtx, xty)
    if solved is not None and min(solved) >= 0:
        return solved
    for _ in range(3 * n):  # each pass frees a term; a few more for terms that step back
        gradient = [xty[i] - sum(xtx[i][j] * x[j] for j in range(n)) for i in range(n)]
        candidates = [i for i in range(n) if i not in free and gradient[i] > tolerance]
        if not candidates:
            break
        free.append(max(candidates, key=lambda i: gradient[i]))
        while True:
            z = [0.0] * n
            sub = _solve_linear([[xtx[i][j] for j in free] for i in free], [xty[i] for i in free])
            if sub is None:  # singular: this term adds nothing the free ones lack
                free.pop()
                break
            for i, value in zip(free, sub):
                z[i] = value
            if min(z[i] for i in free) > 0:
                x = z
                break
            step = min(x[i] / (x[i] - z[i]) for i in free if z[i] <= 0)
            x = [xi + step * (zi - xi) for xi, zi in zip(x, z)]
            free = [i for i in free if x[i] > tolerance]
            x = [xi if i in free else 0.0 for i, xi in enumerate(x)]
    return x


def _solve_linear(a: list[list[float]], b: list[float]) -> list[float] | None:
    """a x = b by Gaussian elimination with partial pivoting (n <= 6); None where a is singular."""
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


def _repeat(round_: int, new_tokens: int, seconds_so_far: float) -> bool:
    """Whether the profile's `round_` (from 0) times its step of `new_tokens` in all."""
    if round_ == 0 or new_tokens <= SMALL_STEP_TOKENS:
        return True
    return round_ < PROFILE_REPEATS and seconds_so_far < REPEAT_WITHIN_SECONDS


def _timed(runner: ModelRunner, batch: list[SequenceInput], ids: list[str], context: int) -> float:
    """Seconds of one forward of `batch`, whose sequences are then cut back to `context` tokens."""
    started = time.perf_counter()
    runner.forward(batch)
    seconds = time.perf_counter() - started
    for i in ids:
        runner.allocator.truncate(i, context)
    return seconds
