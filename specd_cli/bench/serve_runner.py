"""`bench serve`: many concurrent clients against the gateway.

Closed loop (no --request-rate): each of `concurrency` clients sends its next
request as soon as its previous one ends. Poisson: requests are due at a
seeded exponential spacing of mean 1/rate; at most `concurrency` are in flight,
and one due while the cap is reached waits client-side (its latency is timed
from when it is sent, as vLLM's benchmark does).

Each level has prompts of its own (`prompts.level_prompts`), and every method gets the same ones.

Rounds: a level's prompts are split into `rounds` slices, and the methods take
turns over each slice, in an order rotated from one round to the next (with two
methods: A B B A ...). A shared machine drifts by several percent over minutes;
a method whose whole level ran in a slow minute would carry that minute alone.
A slice holds at least MIN_ROUND_CLIENTS times the level's clients, so every
round reaches its full load (a level has fewer rounds where it cannot).
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass

from tqdm import tqdm

from specd_cli.bench.errors import BenchError
from specd_cli.bench.gateway_requests import Gateway
from specd_cli.bench.prompts import Prompt
from specd_cli.bench.records import RequestRecord
from specd_cli.bench.spec_runner import WARMUP_PROMPT, rotated

MIN_ROUND_CLIENTS = 2
# Without --num-prompts a level gets LEVEL_ROUNDS full rounds: a closed loop of as many requests as clients
# is one wave, timed by its burst of prompts and its slowest request's tail more than by serving, and a
# level of one round leaves a method with whatever minute it ran in (measured at 64 clients, 64 prompts:
# one method's ratio to `none` moved from 0.77x to 1.10x between runs of the same code). Low levels, far
# cheaper to measure well and slowest to run, get MIN_LEVEL_PROMPTS; 1,4,16,32,64 then take the 480
# Spec-Bench prompts without repeating one.
LEVEL_ROUNDS = 2
MIN_LEVEL_PROMPTS = 16


@dataclass(frozen=True)
class ServeSettings:
    methods: list[str]
    concurrencies: list[int]
    request_rate: float  # requests / s; math.inf = closed loop
    num_prompts: list[int]  # requests per method at each concurrency
    max_tokens: int
    temperature: float
    seed: int
    warmup: int  # requests per method before measuring; excluded
    timeout_s: float
    rounds: int = 1  # turns the methods take over each level's prompts


def default_num_prompts(concurrency: int) -> int:
    """Requests per method at a level of `concurrency` clients when --num-prompts is not given."""
    return max(MIN_LEVEL_PROMPTS, LEVEL_ROUNDS * MIN_ROUND_CLIENTS * concurrency)


def poisson_send_times(count: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is due; all at 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * count
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(count):
        times.append(t)
        t += rng.expovariate(rate)
    return times


class LoadRunner:
    def __init__(self, gateway: Gateway, settings: ServeSettings, prompts_by_level: list[list[Prompt]]):
        """`prompts_by_level`: each concurrency level's prompts, in the order of `settings.concurrencies`."""
        self.gateway = gateway
        self.settings = settings
        self.prompts_by_level = prompts_by_level

    async def _send(self, prompts: list[Prompt], index: int, method: str, concurrency: int, load_round: int,
                    started: float) -> RequestRecord:
        s = self.settings
        sent_at = time.perf_counter() - started
        seed = s.seed + index if s.temperature > 0 else None
        record = await self.gateway.timed_request(prompts[index], method, s.temperature, seed, s.max_tokens,
                                                  s.timeout_s)
        record.sent_at_s, record.concurrency, record.load_round = sent_at, concurrency, load_round
        return record

    async def run_level(self, method: str, concurrency: int, bar: tqdm, prompts: list[Prompt],
                        indices: range | None = None, load_round: int = 0) -> list[RequestRecord]:
        """The `prompts` at `indices` (all by default) for one method at one concurrency."""
        indices = indices if indices is not None else range(len(prompts))
        started, records = time.perf_counter(), []
        due = poisson_send_times(len(indices), self.settings.request_rate, self.settings.seed)
        in_flight = asyncio.Semaphore(concurrency)

        async def one(position: int, index: int) -> None:
            await asyncio.sleep(max(0.0, due[position] - (time.perf_counter() - started)))
            async with in_flight:
                records.append(await self._send(prompts, index, method, concurrency, load_round, started))
                bar.update()

        await asyncio.gather(*(one(position, index) for position, index in enumerate(indices)))
        return records

    async def warm_up(self) -> None:
        for method in self.settings.methods:
            for _ in range(self.settings.warmup):
                record = await self.gateway.timed_request(WARMUP_PROMPT, method, self.settings.temperature,
                                                          self.settings.seed, self.settings.max_tokens,
                                                          self.settings.timeout_s)
                if record.error:
                    raise BenchError(f"warm-up request of {method} failed: {record.error}")

    async def run(self) -> list[RequestRecord]:
        s = self.settings
        records = []
        total = len(s.methods) * sum(len(prompts) for prompts in self.prompts_by_level)
        with tqdm(total=total, unit="req", desc="bench serve", dynamic_ncols=True) as bar:
            for level, (concurrency, prompts) in enumerate(zip(s.concurrencies, self.prompts_by_level)):
                for load_round, indices in enumerate(self.slices(len(prompts), concurrency)):
                    for method in rotated(s.methods, level + load_round):
                        bar.set_postfix_str(f"{method} concurrency={concurrency} round={load_round + 1}")
                        records.extend(await self.run_level(method, concurrency, bar, prompts, indices, load_round))
        return records

    def slices(self, count: int, concurrency: int) -> list[range]:
        """A level's `count` prompts in up to `rounds` slices of nearly equal size, each of at least
        MIN_ROUND_CLIENTS x `concurrency` prompts (or one slice of them all)."""
        rounds = max(1, min(self.settings.rounds, count // (MIN_ROUND_CLIENTS * concurrency)))
        bounds = [count * n // rounds for n in range(rounds + 1)]
        return [range(start, end) for start, end in zip(bounds, bounds[1:])]
