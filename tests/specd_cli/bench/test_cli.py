"""`specd bench` flags, method resolution, and the files a run writes (without a stack)."""
import json
import math
from pathlib import Path

import pytest

import specd_cli.bench
from specd_cli.bench.cli import _level_counts
from specd_cli.bench.deployment import resolve_methods
from specd_cli.bench.errors import BenchError
from specd_cli.bench.plots import plot_serving, plot_speedup_by_category
from specd_cli.bench.prompts import DEFAULT_SPEC_BENCH, load_spec_bench
from specd_cli.bench.results import git_info, machine_info, write_json
from specd_cli.bench.serve_runner import MIN_ROUND_CLIENTS
from specd_cli.bench.stats import OVERALL, ServeSummary, SpecSummary
from specd_cli.main import _build_parser, main


def test_spec_flags_parse_lists():
    args = _build_parser().parse_args(["bench", "spec", "--methods", "none,ngram", "--temperatures", "0,0.7",
                                       "--baselines", "hf-lookup", "--categories", "coding,math", "--limit", "3"])
    assert (args.methods, args.temperatures, args.baselines, args.categories, args.limit) == \
        (["none", "ngram"], [0.0, 0.7], ["hf-lookup"], ["coding", "math"], 3)


def test_spec_defaults_compare_greedy_and_sampled_against_both_baselines():
    args = _build_parser().parse_args(["bench", "spec"])
    assert (args.temperatures, args.baselines, args.methods, args.gateway) == ([0.0, 1.0], ["hf", "hf-lookup"],
                                                                              None, None)
    assert args.prompts == DEFAULT_SPEC_BENCH


def test_the_default_prompts_are_spec_bench_shipped_in_the_package_with_its_license():
    assert DEFAULT_SPEC_BENCH.parent == Path(specd_cli.bench.__file__).resolve().parent / "data" / "spec_bench"
    assert len(load_spec_bench(DEFAULT_SPEC_BENCH)) == 480
    assert "Apache License" in (DEFAULT_SPEC_BENCH.parent / "LICENSE").read_text()


def test_no_baselines_and_unknown_baselines():
    parser = _build_parser()
    assert parser.parse_args(["bench", "spec", "--baselines", ""]).baselines == []
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "spec", "--baselines", "vllm"])


def test_serve_flags_default_to_a_closed_loop_over_four_concurrencies_in_four_rounds():
    args = _build_parser().parse_args(["bench", "serve", "--num-prompts", "8"])
    assert (args.concurrency, args.request_rate, args.num_prompts, args.rounds) == ([1, 4, 16, 64], math.inf, 8, 4)
    assert _level_counts(args) == [8, 8, 8, 8]


def test_by_default_every_serve_level_gets_two_full_rounds_and_the_five_levels_fit_spec_bench():
    args = _build_parser().parse_args(["bench", "serve", "--concurrency", "1,4,16,32,64"])
    counts = _level_counts(args)
    assert counts == [16, 16, 64, 128, 256]
    assert sum(counts) == len(load_spec_bench(DEFAULT_SPEC_BENCH))
    for concurrency, count in zip(args.concurrency, counts):
        assert count >= 2 * MIN_ROUND_CLIENTS * concurrency


def test_a_missing_prompt_file_is_a_clear_error_before_anything_starts(tmp_path, capsys):
    missing = tmp_path / "nowhere" / "question.jsonl"
    assert main(["bench", "spec", "--prompts", str(missing), "--output-dir", str(tmp_path / "out")]) == 2
    assert f"Spec-Bench file not found: {missing}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_gateway_and_start_stack_exclude_each_other(capsys):
    assert main(["bench", "serve", "--gateway", "127.0.0.1:1", "--start-stack"]) == 2
    assert "exclude each other" in capsys.readouterr().err


def test_a_running_gateway_needs_the_methods_or_its_target(tmp_path, capsys):
    assert main(["bench", "spec", "--gateway", "127.0.0.1:1", "--output-dir", str(tmp_path / "out")]) == 2
    assert "pass --methods" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_methods_always_start_with_none_once():
    assert resolve_methods(["ngram", "none", "ngram"], target=None) == ["none", "ngram"]
    with pytest.raises(BenchError, match="--methods"):
        resolve_methods(None, target=None)


def test_results_name_the_machine_and_commit_and_are_strict_json(tmp_path):
    machine = machine_info(threads=2)
    assert {"cpu_model", "logical_cores", "torch", "torch_threads"} <= set(machine)
    assert set(git_info()) == {"commit", "dirty"}
    path = write_json(tmp_path / "r.json", {"machine": machine, "rate": None})
    assert json.loads(path.read_text())["machine"]["torch_threads"] == 2


def test_plots_are_written_as_png(tmp_path):
    spec = [SpecSummary(system, category, 0.0, 1, 0, 8, 10.0, 1.0, None, 0.1, 0.1, 0.05, 0.06,
                        ratios={"none": speedup}) for category in ("coding", OVERALL)
            for system, speedup in (("none", 1.0), ("ngram", 1.4))]
    pct = {"p50": 0.1, "p95": 0.2, "p99": None}
    serve = [ServeSummary(m, c, 4, 0, 2.0, 2.0, 30.0, pct, pct, pct, pct) for m in ("none", "ngram") for c in (1, 4)]
    for path in (plot_speedup_by_category(spec, tmp_path / "s.png"), plot_serving(serve, tmp_path / "v.png")):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
