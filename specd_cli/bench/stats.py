"""Statistics of request records. Definitions (stated in every report):

- tokens/s of a group: its completion tokens / the sum of its requests' wall times
  (sent -> last token), so long answers weigh by their length, as a user waits.
- speedup (ratio) of A over B: tokens/s of A / tokens/s of B on the same prompts.
- acceptance length (tau): mean tokens out per decoding (verification) step:
  sum(completion_tokens - 1) / sum(verification_steps). The prefill is excluded
  from both: it always yields exactly one token and verifies no draft.
  tau = 1.0 means no gain; the most is num_speculative_tokens + 1.
- acceptance rate: accepted draft tokens / draft tokens.
- TTFT: request sent -> first chunk carrying a token.
- ITL: per generated token after the first; a chunk carrying n tokens that
  arrives g seconds after the previous one contributes n samples of g / n.
- gap (bench serve): the seconds between a stream's consecutive chunks, one
  sample per chunk however many tokens it carries: the pauses a reader sees
  (what vLLM's benchmark calls ITL). Speculation delivers tokens in bursts, so
  it lowers the ITL p50 more than its p99; the gaps show whether steps stall.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from specd_cli.bench.records import RequestRecord

OVERALL = "overall"


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def ttft_s(record: RequestRecord) -> float | None:
    return record.chunks[0][0] if record.chunks else None


def stream_gaps(record: RequestRecord) -> list[float]:
    return [now - previous for (previous, _), (now, _) in zip(record.chunks, record.chunks[1:])]


def inter_token_latencies(record: RequestRecord) -> list[float]:
    samples = []
    for (previous, _), (now, tokens) in zip(record.chunks, record.chunks[1:]):
        samples.extend([(now - previous) / tokens] * tokens)
    return samples


def tokens_per_second(records: Iterable[RequestRecord]) -> float | None:
    records = list(records)
    seconds = sum(r.e2e_s for r in records)
    return sum(r.completion_tokens for r in records) / seconds if seconds > 0 else None


def acceptance_length(records: Iterable[RequestRecord]) -> float | None:
    decoding = [r for r in records if r.verification_steps > 0]
    steps = sum(r.verification_steps for r in decoding)
    return sum(r.completion_tokens - 1 for r in decoding) / steps if steps else None


def acceptance_rate(records: Iterable[RequestRecord]) -> float | None:
    reported = [r for r in records if r.draft_tokens is not None]
    drafts = sum(r.draft_tokens for r in reported)
    return sum(r.accepted_draft_tokens for r in reported) / drafts if drafts else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def _greedy_comparisons(records: Iterable[RequestRecord], reference: str) -> Iterator[tuple[str, str, bool]]:
    """(system, prompt_id, equal to the reference's output) for every successful greedy output."""
    by_prompt: dict[str, dict[str, RequestRecord]] = defaultdict(dict)
    for r in records:
        if r.temperature == 0 and r.ok:
            by_prompt[r.prompt_id][r.system] = r
    for prompt_id, systems in by_prompt.items():
        if reference in systems:
            for system, r in systems.items():
                yield system, prompt_id, r.token_ids == systems[reference].token_ids


def greedy_matches(records: Iterable[RequestRecord], reference: str = "none") -> dict[str, tuple[int, int]]:
    """Per system: (greedy outputs equal to the reference's token for token, outputs compared)."""
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for system, _, equal in _greedy_comparisons(records, reference):
        counts[system][0] += equal
        counts[system][1] += 1
    return {system: (matched, compared) for system, (matched, compared) in counts.items()}


def greedy_mismatches(records: Iterable[RequestRecord], reference: str = "none") -> list[tuple[str, str]]:
    """(system, prompt_id) of every greedy output that differs from the reference's."""
    return [(system, prompt_id) for system, prompt_id, equal in _greedy_comparisons(records, reference) if not equal]


def prompt_length_mismatches(records: Iterable[RequestRecord]) -> list[str]:
    """Prompts whose systems saw different prompt token counts: then they were not given the same input."""
    lengths: dict[str, set[int]] = defaultdict(set)
    for r in records:
        if r.ok:
            lengths[r.prompt_id].add(r.prompt_tokens)
    return [prompt_id for prompt_id, seen in lengths.items() if len(seen) > 1]


@dataclass
class SpecSummary:
    """One system on one category (or OVERALL) at one temperature."""
    system: str
    category: str
    temperature: float
    requests: int
    failed: int
    completion_tokens: int
    tokens_per_s: float | None
    acceptance_length: float | None
    acceptance_rate: float | None
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    itl_p50_s: float | None
    itl_p95_s: float | None
    ratios: dict[str, float | None] = field(default_factory=dict)  # tokens/s over each reference system's
    greedy_matched: int | None = None  # greedy outputs equal to the reference's (None: sampled)
    greedy_compared: int | None = None


def summarize_one(system: str, category: str, temperature: float, records: list[RequestRecord]) -> SpecSummary:
    ok = [r for r in records if r.ok]
    ttfts = [t for t in map(ttft_s, ok) if t is not None]
    itls = [gap for r in ok for gap in inter_token_latencies(r)]
    return SpecSummary(system, category, temperature, len(records), len(records) - len(ok),
                       sum(r.completion_tokens for r in ok), tokens_per_second(ok), acceptance_length(ok),
                       acceptance_rate(ok), percentile(ttfts, 50), percentile(ttfts, 95),
                       percentile(itls, 50), percentile(itls, 95))


def summarize_spec(records: list[RequestRecord], systems: Sequence[str], references: Sequence[str],
                   greedy_reference: str = "none") -> list[SpecSummary]:
    """Per temperature, per category (in order of first appearance) then OVERALL, per system (in the
    given order); ratios to each reference system present in the same (temperature, category) group;
    greedy outputs compared with greedy_reference's."""
    groups: dict[tuple[float, str], dict[str, list[RequestRecord]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        for category in (r.category, OVERALL):
            groups[(r.temperature, category)][r.system].append(r)
    summaries = []
    for (temperature, category), by_system in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] == OVERALL)):
        group = [summarize_one(system, category, temperature, by_system[system])
                 for system in systems if system in by_system]
        speed = {s.system: s.tokens_per_s for s in group}
        matches = greedy_matches([r for rs in by_system.values() for r in rs], greedy_reference)
        for s in group:
            s.ratios = {ref: ratio(s.tokens_per_s, speed[ref]) for ref in references if ref in speed}
            s.greedy_matched, s.greedy_compared = matches.get(s.system, (None, None))
        summaries.extend(group)
    return summaries


@dataclass
class ServeSummary:
    """One system at one concurrency under the serving load."""
    system: str
    concurrency: int
    requests: int
    failed: int
    duration_s: float
    request_throughput: float  # finished requests / s
    output_tokens_per_s: float
    ttft_s: dict[str, float | None]  # "p50", "p95", "p99"
    itl_s: dict[str, float | None]
    gap_s: dict[str, float | None]
    e2e_s: dict[str, float | None]


PERCENTILES = (50, 95, 99)


def _percentiles(values: list[float]) -> dict[str, float | None]:
    return {f"p{q}": percentile(values, q) for q in PERCENTILES}


def _span(records: list[RequestRecord]) -> float:
    """Seconds from the first request sent to the last one finished."""
    return max(r.sent_at_s + r.e2e_s for r in records) - min(r.sent_at_s for r in records)


def summarize_serve_run(system: str, concurrency: int, records: list[RequestRecord]) -> ServeSummary:
    """Duration: the first request sent -> the last request finished (failed ones included), summed over the
    rounds the records ran in."""
    ok = [r for r in records if r.ok]
    rounds: dict[int, list[RequestRecord]] = {}
    for r in records:
        rounds.setdefault(r.load_round, []).append(r)
    duration = sum(map(_span, rounds.values()))
    return ServeSummary(system, concurrency, len(records), len(records) - len(ok), duration,
                        len(ok) / duration if duration > 0 else 0.0,
                        sum(r.completion_tokens for r in ok) / duration if duration > 0 else 0.0,
                        _percentiles([t for t in map(ttft_s, ok) if t is not None]),
                        _percentiles([latency for r in ok for latency in inter_token_latencies(r)]),
                        _percentiles([gap for r in ok for gap in stream_gaps(r)]),
                        _percentiles([r.e2e_s for r in ok]))
