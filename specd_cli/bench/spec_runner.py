"""`bench spec`: every prompt through every system, one request at a time (batch 1).

The systems run back to back on the same prompt, in an order rotated per
prompt, so machine drift and cache warmth hit all of them alike. Baselines run
in this process between specd requests, never at the same time as one. Later
passes (`passes` > 1) run the speculative methods over the same prompts again,
reported as "METHOD pass N": what drafters that learn across requests (suffix
decoding's global tree) learned from the first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tqdm import tqdm

from specd_cli.bench.errors import BenchError
from specd_cli.bench.gateway_requests import Gateway
from specd_cli.bench.prompts import Prompt
from specd_cli.bench.records import RequestRecord

if TYPE_CHECKING:
    from specd_cli.bench.baselines import TransformersBaselines

# Warm-up uses a prompt of its own, so no measured prompt has been seen before by any system.
WARMUP_PROMPT = Prompt("warmup", "warmup", "Write a short poem about the sea, then repeat its first line.")


@dataclass(frozen=True)
class SpecSettings:
    methods: list[str]  # specd methods, "none" first
    baselines: list[str]
    temperatures: list[float]
    seed: int
    max_tokens: int
    warmup: int  # requests per system and temperature before measuring; excluded from the results
    timeout_s: float
    passes: int = 1

    @property
    def systems(self) -> list[str]:
        """What runs in the first pass."""
        return [*self.methods, *self.baselines]

    @property
    def repeated(self) -> list[str]:
        """What runs again in later passes: the speculative methods."""
        return [m for m in self.methods if m != "none"]

    @property
    def reported_systems(self) -> list[str]:
        return [*self.systems, *(pass_label(m, p) for p in range(2, self.passes + 1) for m in self.repeated)]


def pass_label(method: str, number: int) -> str:
    return f"{method} pass {number}"


def rotated(items: list[str], shift: int) -> list[str]:
    shift %= len(items)
    return items[shift:] + items[:shift]


class SpecRunner:
    def __init__(self, gateway: Gateway, settings: SpecSettings, baselines: TransformersBaselines | None):
        self.gateway = gateway
        self.settings = settings
        self.baselines = baselines

    async def run_one(self, system: str, prompt: Prompt, temperature: float, seed: int | None) -> RequestRecord:
        s = self.settings
        if system in s.methods:
            return await self.gateway.timed_request(prompt, system, temperature, seed, s.max_tokens, s.timeout_s)
        return self.baselines.run(system, prompt, temperature, seed, s.max_tokens)

    async def warm_up(self) -> None:
        for temperature in self.settings.temperatures:
            for system in self.settings.systems:
                for _ in range(self.settings.warmup):
                    record = await self.run_one(system, WARMUP_PROMPT, temperature, self.settings.seed)
                    if record.error:
                        raise BenchError(f"warm-up request of {system} failed: {record.error}")

    async def run(self, prompts: list[Prompt]) -> list[RequestRecord]:
        s = self.settings
        records = []
        total = len(s.temperatures) * len(prompts) * (len(s.systems) + (s.passes - 1) * len(s.repeated))
        with tqdm(total=total, unit="req", desc="bench spec", dynamic_ncols=True) as bar:
            for number in range(1, s.passes + 1):
                systems = s.systems if number == 1 else s.repeated
                for temperature in s.temperatures:
                    for index, prompt in enumerate(prompts):
                        # One seed per prompt, shared by every system: the same random stream for each.
                        seed = s.seed + index if temperature > 0 else None
                        for system in rotated(systems, index):
                            bar.set_postfix_str(f"pass {number} T={temperature:g} {prompt.category} {system}")
                            record = await self.run_one(system, prompt, temperature, seed)
                            if number > 1:
                                record.system = pass_label(system, number)
                            records.append(record)
                            bar.update()
        return records
