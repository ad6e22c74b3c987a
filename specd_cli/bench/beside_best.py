"""`auto` beside the fastest single method, per category: what issue 15's goal compares, with how far
the comparison moves with the prompts drawn.

A category's fastest single method is the fastest of several, each measured with the machine's
request-to-request variation (3-7% on a shared 2-core VM), so it is picked partly by luck: on few prompts
the ratio of `auto` to it leans low even where `auto` is as fast as each of them. The interval shows that:
the prompts are resampled with replacement, each resample picks its own fastest method, and the ratio's
2.5th and 97.5th percentiles over the resamples bound it (a paired bootstrap: every system keeps the
requests of the prompts drawn).
"""
from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from specd_cli.bench.records import RequestRecord
from specd_cli.bench.stats import OVERALL, ratio, tokens_per_second

CHOOSER = "auto"
RESAMPLES = 1000
SEED = 0  # resampled alike in every run: the interval depends on the records alone


@dataclass(frozen=True)
class BesideBest:
    """`auto`'s tokens per second over the fastest single method's, on one category (or OVERALL) at one
    temperature."""
    category: str
    temperature: float
    fastest: str  # the fastest single method on all the group's prompts
    ratio: float
    interval: tuple[float, float]  # 95%, over resamples of the prompts


def beside_best(records: list[RequestRecord], methods: Sequence[str]) -> list[BesideBest]:
    """Per temperature, per category (in order of first appearance) then OVERALL: `auto` against the
    fastest of `methods` other than `none` and `auto`, on the prompts every one of them answered. Empty
    without `auto` or another method."""
    singles = [m for m in methods if m not in ("none", CHOOSER)]
    if CHOOSER not in methods or not singles:
        return []
    systems = [CHOOSER, *singles]
    # (temperature, category) -> prompt -> system -> its request
    groups: dict[tuple[float, str], dict[str, dict[str, RequestRecord]]] = defaultdict(lambda: defaultdict(dict))
    for r in records:
        if r.ok and r.system in systems:
            for category in (r.category, OVERALL):
                groups[r.temperature, category][r.prompt_id][r.system] = r
    found = []
    for (temperature, category), by_prompt in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] == OVERALL)):
        answered = [by_prompt[p] for p in sorted(by_prompt) if len(by_prompt[p]) == len(systems)]
        if not answered:
            continue
        fastest, over_fastest = _over_fastest(answered, singles)
        rng = random.Random(SEED)
        resampled = sorted(_over_fastest(rng.choices(answered, k=len(answered)), singles)[1]
                           for _ in range(RESAMPLES))
        interval = (resampled[int(0.025 * RESAMPLES)], resampled[int(0.975 * RESAMPLES) - 1])
        found.append(BesideBest(category, temperature, fastest, over_fastest, interval))
    return found


def _over_fastest(prompts: list[dict[str, RequestRecord]], singles: list[str]) -> tuple[str, float]:
    """The fastest single method on `prompts` (each: system -> its request), and `auto`'s tokens per second
    over its."""
    speeds = {system: tokens_per_second(prompt[system] for prompt in prompts) or 0.0 for system in (CHOOSER, *singles)}
    fastest = max(singles, key=speeds.__getitem__)
    return fastest, ratio(speeds[CHOOSER], speeds[fastest]) or 0.0
