"""Markdown tables for the README and the terminal."""
from __future__ import annotations

from collections.abc import Sequence

from specd_cli.bench.beside_best import RESAMPLES, BesideBest
from specd_cli.bench.records import BASELINE_SYSTEMS
from specd_cli.bench.stats import OVERALL, ServeSummary, SpecSummary

DEFINITIONS = (
    "tok/s: completion tokens / summed request wall time; `vs X`: tok/s over X's on the same prompts; "
    "tau: mean tokens per decoding step, (completion - 1) / verification steps, the prefill excluded; "
    "acc: accepted / draft tokens; TTFT: sent -> first token; ITL: per token after the first "
    "(a chunk of n tokens gives n gaps of 1/n of its interval); greedy = none: outputs equal to specd none's "
    "token for token.")


def label(system: str) -> str:
    return system if system in BASELINE_SYSTEMS else f"specd {system}"


def fmt(value: float | None, digits: int = 1, unit: str = "") -> str:
    return "—" if value is None else f"{value:.{digits}f}{unit}"


def ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1000:.0f}"


def _matches(s: SpecSummary) -> str:
    return "—" if s.greedy_compared is None else f"{s.greedy_matched}/{s.greedy_compared}"


def _requests(s: SpecSummary) -> str:
    return f"{s.requests} ({s.failed} failed)" if s.failed else str(s.requests)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def spec_table(summaries: list[SpecSummary], references: list[str], by_category: bool) -> str:
    """One table of one temperature: the OVERALL rows, or every category's rows."""
    header = (["category"] if by_category else []) + \
        ["system", "req", "tok/s", *[f"vs {r}" for r in references], "tau", "acc", "TTFT p50 ms",
         "ITL p50 ms", "ITL p95 ms", "greedy = none"]
    rows = []
    for s in summaries:
        if by_category == (s.category == OVERALL):
            continue
        rows.append(([s.category] if by_category else []) + [
            label(s.system), _requests(s), fmt(s.tokens_per_s),
            *[fmt(s.ratios.get(r), 2, "×") for r in references],
            fmt(s.acceptance_length, 2), fmt(s.acceptance_rate, 2), ms(s.ttft_p50_s), ms(s.itl_p50_s),
            ms(s.itl_p95_s), _matches(s)])
    return markdown_table(header, rows)


BESIDE_BEST_DEFINITIONS = (
    "`auto` / fastest single: `auto`'s tok/s over the fastest other specd method's (`none` aside) on the "
    f"prompts all of them answered; 95% interval: of that ratio over {RESAMPLES:,} resamples of those prompts with "
    "replacement, each resample picking its own fastest method (`specd_cli/bench/beside_best.py`).")


def beside_best_table(rows: Sequence[BesideBest]) -> str:
    """`auto` beside the fastest single method: OVERALL first, then every category."""
    ordered = sorted(rows, key=lambda row: row.category != OVERALL)
    return markdown_table(["category", "fastest single", "`auto` / fastest single", "95% interval"],
                          [[row.category, label(row.fastest), fmt(row.ratio, 3, "×"),
                            f"{row.interval[0]:.3f}-{row.interval[1]:.3f}"] for row in ordered])


def spec_report(summaries: list[SpecSummary], references: list[str], header_line: str,
                beside: Sequence[BesideBest] = ()) -> str:
    parts = [header_line, ""]
    for temperature in sorted({s.temperature for s in summaries}):
        rows = [s for s in summaries if s.temperature == temperature]
        mode = "greedy" if temperature == 0 else f"sampled, temperature {temperature:g}"
        parts += [f"**Overall, {mode}**", "", spec_table(rows, references, by_category=False), "",
                  f"**By category, {mode}**", "", spec_table(rows, references, by_category=True), ""]
        if compared := [row for row in beside if row.temperature == temperature]:
            parts += [f"**`auto` beside the fastest single method, {mode}**", "", beside_best_table(compared), ""]
    parts.append(DEFINITIONS)
    if beside:
        parts.append(BESIDE_BEST_DEFINITIONS)
    return "\n".join(parts)


def serve_report(summaries: list[ServeSummary], header_line: str) -> str:
    header = ["system", "concurrency", "req", "failed", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p95 ms",
              "TTFT p99 ms", "ITL p50 ms", "ITL p95 ms", "ITL p99 ms", "gap p50 ms", "gap p99 ms", "E2E p50 s"]
    rows = [[label(s.system), str(s.concurrency), str(s.requests), str(s.failed), fmt(s.request_throughput, 2),
             fmt(s.output_tokens_per_s), ms(s.ttft_s["p50"]), ms(s.ttft_s["p95"]), ms(s.ttft_s["p99"]),
             ms(s.itl_s["p50"]), ms(s.itl_s["p95"]), ms(s.itl_s["p99"]), ms(s.gap_s["p50"]), ms(s.gap_s["p99"]),
             fmt(s.e2e_s["p50"], 2)]
            for s in summaries]
    return "\n".join([header_line, "", markdown_table(header, rows), "",
                      "req/s and out tok/s: over the run's wall time (first sent -> last finished); "
                      "TTFT, ITL as in `specd bench spec`; gap: seconds between a stream's chunks."])


def header_line(kind: str, created: str, machine: dict, git: dict, settings: dict) -> str:
    """Date, machine, commit and the settings that decide the numbers, in one line above the table."""
    commit = (git.get("commit") or "unknown")[:10] + (" (dirty)" if git.get("dirty") else "")
    shown = ", ".join(f"{k} {v}" for k, v in settings.items())
    load = machine.get("load_average_1_5_15m")
    busy = f", load average {load[1]:g} at the end" if load else ""
    return (f"`specd bench {kind}`, {created[:10]}, {machine['cpu_model']} ({machine['usable_cores']} cores{busy}), "
            f"torch {machine['torch']}, {machine['torch_threads']} threads, commit {commit}; {shown}.")
