"""PNG plots of a run (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from specd_cli.bench.report import label  # noqa: E402
from specd_cli.bench.stats import OVERALL, ServeSummary, SpecSummary  # noqa: E402


def plot_speedup_by_category(summaries: list[SpecSummary], path: Path, reference: str = "none") -> Path:
    """One panel per temperature: bars of tok/s over the reference's, per category and overall."""
    temperatures = sorted({s.temperature for s in summaries})
    fig, axes = plt.subplots(len(temperatures), 1, figsize=(11, 4 * len(temperatures)), squeeze=False)
    for ax, temperature in zip(axes[:, 0], temperatures):
        rows = [s for s in summaries if s.temperature == temperature]
        categories = list(dict.fromkeys(s.category for s in rows if s.category != OVERALL)) + [OVERALL]
        systems = [s for s in dict.fromkeys(r.system for r in rows) if s != reference]
        width = 0.8 / max(1, len(systems))
        for i, system in enumerate(systems):
            by_category = {s.category: s.ratios.get(reference) for s in rows if s.system == system}
            bars = ax.bar([c + i * width for c in range(len(categories))],
                          [by_category.get(c) or 0.0 for c in categories], width, label=label(system))
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([c + width * (len(systems) - 1) / 2 for c in range(len(categories))], categories,
                      rotation=30, ha="right")
        mode = "greedy" if temperature == 0 else f"temperature {temperature:g}"
        ax.set_ylabel(f"speedup over specd {reference}")
        ax.set_title(f"Spec-Bench, batch 1, {mode}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_serving(summaries: list[ServeSummary], path: Path) -> Path:
    """Throughput, TTFT and ITL against concurrency, one line per system."""
    panels = [("output tokens/s", lambda s: s.output_tokens_per_s),
              ("TTFT p50 (ms)", lambda s: _ms(s.ttft_s["p50"])),
              ("ITL p50 (ms)", lambda s: _ms(s.itl_s["p50"])),
              ("ITL p95 (ms)", lambda s: _ms(s.itl_s["p95"]))]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4))
    for ax, (title, value) in zip(axes, panels):
        for system in dict.fromkeys(s.system for s in summaries):
            rows = sorted((s for s in summaries if s.system == system), key=lambda s: s.concurrency)
            ax.plot([s.concurrency for s in rows], [value(s) for s in rows], marker="o", label=label(system))
        concurrencies = sorted({s.concurrency for s in summaries})
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _ms(seconds: float | None) -> float:
    return math.nan if seconds is None else seconds * 1000
