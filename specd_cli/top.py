"""`specd top`: a live terminal view of a running deployment, read from the services' /metrics.

For people with no Grafana open: per speculative method, throughput, acceptance
rate and mean acceptance length, draft vs accepted tokens, latency; plus the
target's queue and KV cache and each drafter's health. Throughput is measured
over the last refresh interval; acceptance and latency percentiles are since
the services started (the counters and histograms are cumulative).
"""
from __future__ import annotations

import argparse
import math
import time
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from specd import defaults

CLEAR_SCREEN = "\x1b[H\x1b[2J"


# -- scraping -------------------------------------------------------------------

@dataclass
class Scrape:
    """Every sample one /metrics endpoint served, or why it served none."""
    url: str
    samples: list = field(default_factory=list)  # prometheus_client Samples: name, labels, value
    error: str | None = None

    def total(self, name: str, **labels: str) -> float:
        """Sum of the samples called `name` whose labels include `labels`."""
        return sum(s.value for s in self._matching(name, labels))

    def by_label(self, name: str, label: str, **labels: str) -> dict[str, float]:
        """Sums of `name` per value of `label`."""
        sums: dict[str, float] = {}
        for s in self._matching(name, labels):
            sums[s.labels[label]] = sums.get(s.labels[label], 0.0) + s.value
        return sums

    def quantile(self, q: float, histogram: str, **labels: str) -> float | None:
        buckets = self.by_label(f"{histogram}_bucket", "le", **labels)
        return histogram_quantile(q, [(float(le), count) for le, count in buckets.items()])

    def _matching(self, name: str, labels: dict[str, str]):
        return (s for s in self.samples if s.name == name and labels.items() <= s.labels.items())


def scrape(url: str, timeout_s: float = 2.0) -> Scrape:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            text = response.read().decode()
    except OSError as err:  # refused, timed out, HTTP error: the view shows it and goes on
        return Scrape(url, error=str(getattr(err, "reason", err)))
    return parse_scrape(url, text)


def parse_scrape(url: str, text: str) -> Scrape:
    """A Scrape of Prometheus text exposition format."""
    return Scrape(url, [s for family in text_string_to_metric_families(text) for s in family.samples])


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' estimate from cumulative (upper bound, count) buckets: linear within the bucket."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] == 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank and count > below:
            if math.isinf(upper):  # the open top bucket: the best guess is the largest finite bound
                return lower
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


@dataclass
class Snapshot:
    """One scrape of every service, and when it was taken."""
    taken_at: float
    target: Scrape
    gateway: Scrape
    drafters: list[Scrape]


def take_snapshot(target_url: str, gateway_url: str, drafter_urls: list[str]) -> Snapshot:
    return Snapshot(time.monotonic(), scrape(target_url), scrape(gateway_url), [scrape(u) for u in drafter_urls])


# -- rendering ------------------------------------------------------------------

def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 0.001:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _counts(counts: dict[str, float]) -> str:
    return ", ".join(f"{key} {value:.0f}" for key, value in sorted(counts.items())) or "none"


def render(before: Snapshot, now: Snapshot) -> str:
    seconds = max(now.taken_at - before.taken_at, 1e-9)
    lines = [f"specd top · throughput over the last {seconds:.1f} s; acceptance and percentiles since start"]
    lines += _target_lines(before.target, now.target, seconds)
    lines += _gateway_lines(now.gateway)
    lines += _drafter_lines(now.target, now.drafters)
    return "\n".join(lines)


def _target_lines(before: Scrape, now: Scrape, seconds: float) -> list[str]:
    if now.error:
        return [f"target     {now.url} unreachable: {now.error}"]
    used, total = now.total("specd_kv_cache_blocks_used"), now.total("specd_kv_cache_blocks_total")
    lines = [
        f"requests   running {now.total('specd_requests_running'):.0f}   "
        f"waiting {now.total('specd_requests_waiting'):.0f}   "
        f"finished: {_counts(now.by_label('specd_requests_finished_total', 'reason'))}",
        f"KV cache   {used:.0f} / {total:.0f} blocks ({_percent(_ratio(used, total))})   "
        f"preemptions {now.total('specd_preemptions_total'):.0f}   "
        f"prefill chunks {now.total('specd_prefill_chunks_total'):.0f}   "
        f"rejected {now.total('specd_requests_rejected_total'):.0f}   "
        f"steps not asking drafters {now.total('specd_drafting_skipped_steps_total'):.0f}",
        _step_line(before, now),
        "",
        f"{'method':<10}{'out tok/s':>10}{'draft tok/s':>13}{'accepted tok/s':>16}{'accept rate':>13}"
        f"{'accept len':>12}{'TTFT p50':>10}{'ITL p50':>10}",
    ]
    for method in sorted(now.by_label("specd_output_tokens_total", "method")):
        lines.append(_method_row(before, now, method, seconds))
    return lines


def _step_line(before: Scrape, now: Scrape) -> str:
    """The cost model's choice over the interval: drafts verified per step, tokens and seconds it
    predicted for the steps against what they gave."""
    def delta(name: str) -> float:
        return now.total(name) - before.total(name)

    steps = delta("specd_step_draft_tokens_count")
    return (f"steps      drafts/step {_ratio(delta('specd_step_draft_tokens_sum'), steps) or 0:.1f}   "
            f"tokens predicted {delta('specd_predicted_step_tokens_total'):.0f} / "
            f"realized {delta('specd_realized_step_tokens_total'):.0f}   "
            f"seconds predicted {delta('specd_predicted_step_seconds_total'):.2f} / "
            f"realized {delta('specd_realized_step_seconds_total'):.2f}")


def _method_row(before: Scrape, now: Scrape, method: str, seconds: float) -> str:
    def per_second(name: str) -> float:
        # Never negative: a restarted target starts its counters again from zero.
        return max(0.0, now.total(name, method=method) - before.total(name, method=method)) / seconds
    drafted = now.total("specd_draft_tokens_total", method=method)
    accepted = now.total("specd_accepted_tokens_total", method=method)
    steps = now.total("specd_verification_steps_total", method=method)
    # Every verification step emits its accepted drafts plus one token of the target's own.
    length = _ratio(steps + accepted, steps)
    return (f"{method:<10}{per_second('specd_output_tokens_total'):>10.1f}"
            f"{per_second('specd_draft_tokens_total'):>13.1f}{per_second('specd_accepted_tokens_total'):>16.1f}"
            f"{_percent(_ratio(accepted, drafted)):>13}{_number(length):>12}"
            f"{_duration(now.quantile(0.5, 'specd_time_to_first_token_seconds', method=method)):>10}"
            f"{_duration(now.quantile(0.5, 'specd_inter_token_latency_seconds', method=method)):>10}")


def _gateway_lines(gateway: Scrape) -> list[str]:
    if gateway.error:
        return ["", f"gateway    {gateway.url} unreachable: {gateway.error}"]
    return ["", f"gateway    streams {gateway.total('specd_gateway_requests_running'):.0f}   "
                f"TTFT p50 {_duration(gateway.quantile(0.5, 'specd_gateway_time_to_first_token_seconds'))}   "
                f"ITL p50 {_duration(gateway.quantile(0.5, 'specd_gateway_inter_token_latency_seconds'))}   "
                f"Generate: {_counts(gateway.by_label('specd_rpc_requests_total', 'code', rpc_method='Generate'))}"]


def _drafter_lines(target: Scrape, drafters: list[Scrape]) -> list[str]:
    """One row per drafter method: the target's view of its Propose RPCs, then the drafter's own."""
    asked = {} if target.error else target.by_label("specd_drafter_rpc_seconds_count", "method")
    serving = {method: drafter for drafter in drafters if not drafter.error
               for method in drafter.by_label("specd_drafter_proposals_total", "method")}
    lines = ["", f"{'drafter':<10}{'RPC p50':>10}{'propose p50':>13}{'empty drafts':>14}{'sequences':>11}   failures"]
    for method in sorted(set(asked) | set(serving)):
        lines.append(_drafter_row(target, serving.get(method), method))
    return lines + [f"drafter    {d.url} unreachable: {d.error}" for d in drafters if d.error]


def _drafter_row(target: Scrape, drafter: Scrape | None, method: str) -> str:
    rpc_p50 = None if target.error else target.quantile(0.5, "specd_drafter_rpc_seconds", method=method)
    failures = {} if target.error else target.by_label("specd_drafter_rpc_failures_total", "code", method=method)
    propose_p50 = empty = sequences = None
    if drafter is not None:
        propose_p50 = drafter.quantile(0.5, "specd_drafter_propose_seconds", method=method)
        empty = _ratio(drafter.total("specd_drafter_empty_drafts_total", method=method),
                       drafter.total("specd_drafter_proposals_total", method=method))
        sequences = f"{drafter.total('specd_drafter_sequences'):.0f}"
    return (f"{method:<10}{_duration(rpc_p50):>10}{_duration(propose_p50):>13}{_percent(empty):>14}"
            f"{sequences or '-':>11}   {_counts(failures)}")


# -- the command ----------------------------------------------------------------

def _metrics_url(address: str) -> str:
    return f"http://{address}/metrics"


def register(commands) -> None:
    """Add `specd top` to the CLI's subcommands."""
    top = commands.add_parser("top", help="live view of acceptance, throughput and latency from the services' /metrics")
    top.add_argument("--target-metrics", default=_metrics_url(defaults.TARGET_METRICS_ADDRESS), metavar="URL",
                     help="the target's /metrics (default %(default)s)")
    top.add_argument("--gateway-metrics", default=_metrics_url(defaults.GATEWAY_METRICS_ADDRESS), metavar="URL",
                     help="the gateway's /metrics (default %(default)s)")
    top.add_argument("--drafter-metrics", action="append", metavar="URL",
                     help=f"a drafter's /metrics, repeatable (default {_metrics_url(defaults.DRAFTER_METRICS_ADDRESS)})")
    top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    top.add_argument("--once", action="store_true", help="print one view (two scrapes --interval apart) and exit")
    top.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Refresh until Ctrl-C, or print once; exit 1 if no service answered."""
    drafter_urls = args.drafter_metrics or [_metrics_url(defaults.DRAFTER_METRICS_ADDRESS)]
    before = take_snapshot(args.target_metrics, args.gateway_metrics, drafter_urls)
    try:
        while True:
            time.sleep(args.interval)
            now = take_snapshot(args.target_metrics, args.gateway_metrics, drafter_urls)
            print(("" if args.once else CLEAR_SCREEN) + render(before, now), flush=True)
            if args.once:
                return 0 if any(not s.error for s in (now.target, now.gateway, *now.drafters)) else 1
            before = now
    except KeyboardInterrupt:
        return 0
