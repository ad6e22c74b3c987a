"""`specd bench spec` and `specd bench serve`: argument parsing and the run of each.

Heavy imports (torch, transformers, matplotlib, tqdm) happen inside the commands,
so every other `specd` command starts fast and runs without the `bench` extra.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import math
import sys
from dataclasses import asdict
from pathlib import Path

from specd.model_store import DEFAULT_MODEL
from specd_cli.bench.errors import BenchError
from specd_cli.bench.gateway_requests import PROTOCOLS
from specd_cli.bench.prompts import DEFAULT_SPEC_BENCH
from specd_cli.bench.records import BASELINE_SYSTEMS
from specd_cli.signals import interrupt_on_sigterm
from specd_cli.soak import cli as soak_cli

BENCH_EXTRA = ("matplotlib", "tqdm")  # what `pip install 'specd[bench]'` adds for plots and progress bars


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _floats(text: str) -> list[float]:
    return [float(item) for item in _csv(text)]


def _ints(text: str) -> list[int]:
    return [int(item) for item in _csv(text)]


def _baselines(text: str) -> list[str]:
    names = _csv(text)
    if unknown := [n for n in names if n not in BASELINE_SYSTEMS]:
        raise argparse.ArgumentTypeError(f"unknown baseline {', '.join(unknown)}; known: {', '.join(BASELINE_SYSTEMS)}")
    return names


def _add_common_flags(parser: argparse.ArgumentParser, max_tokens: int, warmup: int) -> argparse._ArgumentGroup:
    """Flags both commands share; returns the "what to run" group for the command's own flags."""
    where = parser.add_argument_group("the stack under test")
    where.add_argument("--gateway", default=None,
                       help="a running gateway: its gRPC address, or with --protocol http its API's base URL "
                            "(e.g. http://127.0.0.1:8000/v1) (default: start a stack)")
    where.add_argument("--protocol", choices=PROTOCOLS, default="grpc",
                       help="the gateway's API to drive: gRPC or the OpenAI-compatible HTTP one (default grpc)")
    where.add_argument("--target", default=None,
                       help="address of that deployment's target, to list its methods (with --gateway)")
    where.add_argument("--start-stack", action="store_true",
                       help="start gateway + target + drafter on free loopback ports (the default without --gateway)")
    where.add_argument("--model", default=DEFAULT_MODEL,
                       help=f"model of the started stack and of the baselines (default {DEFAULT_MODEL})")
    where.add_argument("--threads", type=int, default=None,
                       help="torch threads of the started target and of the baselines (default: torch's default); "
                            "with --gateway, pass the running target's")
    where.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                       help="dtype of the started target and of the transformers baselines (default float32); "
                            "with --gateway, pass the running target's")
    where.add_argument("--warm-corpus", default=None, metavar="FILE|none",
                       help="what the started stack's suffix and trie drafters start from: a file of `specd train "
                            "corpus`, or none (default: the corpus shipped for --model, if any)")
    where.add_argument("--step-logs", action="store_true",
                       help="each started target writes one JSON line per step to steps.jsonl beside its log "
                            "(`specd serve target --step-log`)")
    where.add_argument("--draft-layers", type=int, default=None, metavar="N",
                       help="draft_model in the started stack: the target's first N layers (LayerSkip's early exit; "
                            "default: the whole target)")
    what = parser.add_argument_group("what to run")
    what.add_argument("--methods", type=_csv, default=None,
                      help="specd methods to compare, e.g. none,ngram; `none` is always added "
                           "(default: every method the target serves)")
    what.add_argument("--prompts", type=Path, default=DEFAULT_SPEC_BENCH,
                      help=f"Spec-Bench-format JSONL: question_id, category, turns (default {DEFAULT_SPEC_BENCH})")
    what.add_argument("--max-tokens", type=int, default=max_tokens,
                      help=f"max_tokens of every request, the same for every system (default {max_tokens})")
    what.add_argument("--seed", type=int, default=0, help="base seed of sampled requests (default 0)")
    what.add_argument("--warmup", type=int, default=warmup,
                      help=f"untimed warm-up requests per system before measuring (default {warmup})")
    what.add_argument("--timeout", type=float, default=600.0, help="per-request deadline in seconds (default 600)")
    what.add_argument("--output-dir", type=Path, default=Path("bench_results"),
                      help="a folder per run goes here (default bench_results/)")
    return what


def register(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="benchmark a specd stack (Spec-Bench, serving load)")
    kinds = bench.add_subparsers(dest="bench", required=True)

    spec = kinds.add_parser("spec", help="Spec-Bench prompts one at a time: speedup per category, with baselines",
                            description="Every prompt through every system back to back (batch 1), greedy and "
                                        "sampled; tok/s, speedup over none and the baselines, acceptance, "
                                        "TTFT/ITL, and whether greedy outputs equal none's.")
    spec_flags = _add_common_flags(spec, max_tokens=256, warmup=2)
    spec_flags.add_argument("--categories", type=_csv, default=None, help="only these categories (default all)")
    spec_flags.add_argument("--limit", type=int, default=None,
                            help="the first N prompts of EACH category (default all)")
    spec_flags.add_argument("--temperatures", type=_floats, default=[0.0, 1.0],
                            help="0 = greedy; each temperature is a full pass (default 0,1)")
    spec_flags.add_argument("--baselines", type=_baselines, default=list(BASELINE_SYSTEMS),
                            help="transformers generate: hf (plain) and hf-lookup (prompt lookup); '' for none "
                                 "(default hf,hf-lookup)")
    spec_flags.add_argument("--passes", type=int, default=1,
                            help="run the speculative methods over the prompts this many times; later passes "
                                 "show what drafters learned from the earlier ones (default 1)")
    spec_flags.add_argument("--prompt-lookup-num-tokens", type=int, default=10,
                            help="draft length of the hf-lookup baseline (default 10)")
    spec.set_defaults(run=run_spec)

    serve = kinds.add_parser("serve", help="concurrent clients: throughput and latency against concurrency",
                             description="num-prompts requests per method and concurrency level, closed loop or "
                                         "Poisson arrivals; request and token throughput, TTFT/ITL percentiles "
                                         "and failed requests.")
    serve_flags = _add_common_flags(serve, max_tokens=128, warmup=2)
    serve_flags.add_argument("--sharegpt", type=Path, default=None,
                             help="ShareGPT-format JSON to take prompts from instead of --prompts (first human turn)")
    serve_flags.add_argument("--concurrency", type=_ints, default=[1, 4, 16, 64],
                             help="most requests in flight; one run per value (default 1,4,16,64)")
    serve_flags.add_argument("--request-rate", type=float, default=math.inf,
                             help="Poisson arrivals at this many requests/s (default inf: closed loop, each client "
                                  "sends its next request when the last one ends)")
    serve_flags.add_argument("--num-prompts", type=int, default=None,
                             help="requests per method and concurrency, drawn from the prompt set; each level "
                                  "gets prompts of its own while the set has enough (default: two rounds at "
                                  "every level, 4 x its clients, at least 16)")
    serve_flags.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    serve_flags.add_argument("--rounds", type=int, default=4,
                             help="the methods take turns over each level's prompts in this many slices, each of "
                                  "at least twice the level's clients, in an order rotated each round, so that a "
                                  "shared machine's drift falls on every method alike (default 4)")
    serve.set_defaults(run=run_serve)
    soak_cli.register(kinds)


def run_spec(args: argparse.Namespace) -> int:
    return _run(_spec, args)


def run_serve(args: argparse.Namespace) -> int:
    return _run(_serve, args)


def _run(command, args: argparse.Namespace) -> int:
    if missing := [name for name in BENCH_EXTRA if importlib.util.find_spec(name) is None]:
        print(f"specd bench: needs {' and '.join(missing)}: pip install 'specd[bench]'", file=sys.stderr)
        return 2
    if args.gateway and args.start_stack:
        print("specd bench: --gateway and --start-stack exclude each other", file=sys.stderr)
        return 2
    if args.gateway and not (args.target or args.methods):
        print("specd bench: with --gateway, pass --methods (e.g. none,ngram) or --target", file=sys.stderr)
        return 2
    interrupt_on_sigterm()
    try:
        return asyncio.run(command(args))
    except BenchError as err:
        print(f"specd bench: {err}", file=sys.stderr)
        return 2


async def _spec(args: argparse.Namespace) -> int:
    import torch

    from specd_cli.bench import results
    from specd_cli.bench.prompts import load_spec_bench

    threads = args.threads or torch.get_num_threads()
    prompts = load_spec_bench(args.prompts, args.categories, args.limit)
    run_dir = results.new_run_dir(args.output_dir, "spec")
    settings, records = await _measure_spec(args, prompts, threads, run_dir)
    _write_spec(args, settings, prompts, records, threads, run_dir)
    return _verdict(records, settings.methods, run_dir)


def _stack_shown(args: argparse.Namespace) -> dict[str, str]:
    """The report's lines on the stack: what the learning drafters started from (a started one), and that
    each method learns in a corpus scope of its own."""
    from drafter_svc import warm_corpus

    shown = {"scopes": "each method's requests in a corpus scope of their own (what suffix and trie learn)"}
    if not args.gateway:
        corpus = warm_corpus.resolve(args.warm_corpus, args.model)
        shown["warm corpus"] = f"{corpus.name if corpus else 'none'} (what suffix and trie start from)"
    return shown


async def _measure_spec(args: argparse.Namespace, prompts, threads: int, run_dir: Path):
    from specd.model_store import resolve_model
    from specd_cli.bench.deployment import deployment
    from specd_cli.bench.gateway_requests import connected
    from specd_cli.bench.spec_runner import SpecRunner, SpecSettings

    with deployment(args.gateway, args.target, args.model, threads, args.dtype, run_dir / "logs",
                    args.methods, args.draft_layers, args.protocol, args.warm_corpus, args.step_logs) as stack:
        settings = SpecSettings(stack.methods, args.baselines, args.temperatures,
                                args.seed, args.max_tokens, args.warmup, args.timeout, args.passes)
        baselines = None
        if args.baselines:
            import torch

            from specd_cli.bench.baselines import TransformersBaselines
            baselines = TransformersBaselines(resolve_model(args.model), threads, args.prompt_lookup_num_tokens,
                                              getattr(torch, args.dtype))
        async with connected(args.protocol, stack.gateway) as gateway:
            runner = SpecRunner(gateway, settings, baselines)
            await runner.warm_up()
            return settings, await runner.run(prompts)


def _write_spec(args: argparse.Namespace, settings, prompts, records, threads: int, run_dir: Path) -> None:
    from specd_cli.bench import plots, report, results, stats
    from specd_cli.bench.beside_best import beside_best

    references = ["none", *settings.baselines]
    summaries = stats.summarize_spec(records, settings.reported_systems, references)
    beside = beside_best(records, settings.methods)
    created = datetime.datetime.now().isoformat(timespec="seconds")
    machine, git = results.machine_info(threads), results.git_info()
    chosen = (f" in {','.join(args.categories)}" if args.categories else "") + \
             (f", the first {args.limit} per category" if args.limit else "")
    shown = {"model": args.model, "max_tokens": args.max_tokens,
             "prompts": f"{len(prompts)} from {args.prompts.name}{chosen}",
             "warm-up": f"{args.warmup} untimed request(s) per system and temperature, excluded",
             **_stack_shown(args)}
    text = report.spec_report(summaries, references, report.header_line("spec", created, machine, git, shown),
                              beside)
    results.write_json(run_dir / "results.json", {
        "kind": "spec", "created": created, "machine": machine, "git": git,
        "settings": {**asdict(settings), "model": args.model, "dtype": args.dtype, "threads": threads, "prompts_file": str(args.prompts),
                     "categories": args.categories, "limit_per_category": args.limit,
                     "prompt_lookup_num_tokens": args.prompt_lookup_num_tokens,
                     "gateway": args.gateway or "started by the bench"},
        "definitions": stats.__doc__, "summaries": summaries, "beside_best": beside,
        "records": [r.to_json() for r in records]})
    (run_dir / "report.md").write_text(text + "\n")
    plots.plot_speedup_by_category(summaries, run_dir / "speedup_by_category.png")
    print(text)


def _verdict(records, methods: list[str], run_dir: Path) -> int:
    """Exit status 1 if a request failed, the systems saw different prompts, or a specd method's
    greedy output differs from none's (a baseline's may differ by float rounding: reported only)."""
    from specd_cli.bench.stats import greedy_mismatches, prompt_length_mismatches

    failed = _print_failures(records)
    unequal_inputs = prompt_length_mismatches(records)
    for prompt_id in unequal_inputs:
        print(f"specd bench: the systems got different prompt token counts on prompt {prompt_id} "
              f"(is --model the deployment's model?)", file=sys.stderr)
    mismatched = [(s, p) for s, p in greedy_mismatches(records) if s in methods]
    for system, prompt_id in mismatched:
        print(f"specd bench: greedy output of {system} differs from none's on prompt {prompt_id}", file=sys.stderr)
    print(f"\nresults in {run_dir}/", file=sys.stderr)
    return 1 if failed or unequal_inputs or mismatched else 0


def _print_failures(records) -> int:
    failed = [r for r in records if not r.ok]
    for r in failed:
        where = f" at concurrency {r.concurrency}" if r.concurrency else ""
        print(f"specd bench: FAILED {r.system}{where}, prompt {r.prompt_id}: {r.error}", file=sys.stderr)
    if failed:
        print(f"specd bench: {len(failed)} of {len(records)} requests failed", file=sys.stderr)
    return len(failed)


def _level_counts(args: argparse.Namespace) -> list[int]:
    """Requests per method at each concurrency level: --num-prompts, or `default_num_prompts`."""
    from specd_cli.bench.serve_runner import default_num_prompts

    return [default_num_prompts(concurrency) if args.num_prompts is None else args.num_prompts
            for concurrency in args.concurrency]


def _slashed(values: list[int]) -> str:
    return "/".join(map(str, values))


async def _serve(args: argparse.Namespace) -> int:
    import torch

    from specd_cli.bench import results
    from specd_cli.bench.prompts import level_prompts, load_sharegpt, load_spec_bench

    threads = args.threads or torch.get_num_threads()
    pool = load_sharegpt(args.sharegpt) if args.sharegpt else load_spec_bench(args.prompts)
    counts = _level_counts(args)
    if len(pool) < sum(counts):
        print(f"specd bench: {len(pool)} prompts for levels of {_slashed(counts)}: later levels repeat "
              f"earlier levels' prompts, which drafters that learn across requests will have seen answered",
              file=sys.stderr)
    prompts = level_prompts(pool, counts, args.seed)
    run_dir = results.new_run_dir(args.output_dir, "serve")
    settings, records = await _measure_serve(args, prompts, threads, run_dir)
    _write_serve(args, settings, records, threads, run_dir)
    failed = _print_failures(records)
    print(f"\nresults in {run_dir}/", file=sys.stderr)
    return 1 if failed else 0


async def _measure_serve(args: argparse.Namespace, prompts, threads: int, run_dir: Path):
    from specd_cli.bench.deployment import deployment
    from specd_cli.bench.gateway_requests import connected
    from specd_cli.bench.serve_runner import LoadRunner, ServeSettings

    with deployment(args.gateway, args.target, args.model, threads, args.dtype, run_dir / "logs",
                    args.methods, args.draft_layers, args.protocol, args.warm_corpus, args.step_logs) as stack:
        settings = ServeSettings(stack.methods, args.concurrency, args.request_rate,
                                 [len(level) for level in prompts], args.max_tokens, args.temperature, args.seed,
                                 args.warmup, args.timeout, args.rounds)
        async with connected(args.protocol, stack.gateway) as gateway:
            runner = LoadRunner(gateway, settings, prompts)
            await runner.warm_up()
            return settings, await runner.run()


def _write_serve(args: argparse.Namespace, settings, records, threads: int, run_dir: Path) -> None:
    from specd_cli.bench import plots, report, results, stats

    summaries = [stats.summarize_serve_run(method, concurrency,
                                           [r for r in records if r.system == method and r.concurrency == concurrency])
                 for concurrency in settings.concurrencies for method in settings.methods]
    created = datetime.datetime.now().isoformat(timespec="seconds")
    machine, git = results.machine_info(threads), results.git_info()
    closed_loop = math.isinf(args.request_rate)
    source = args.sharegpt or args.prompts
    shown = {"model": args.model, "max_tokens": args.max_tokens, "temperature": f"{args.temperature:g}",
             "arrivals": "closed loop" if closed_loop else f"Poisson {args.request_rate:g} req/s",
             "requests": f"{_slashed(settings.num_prompts)} per method at concurrency "
                         f"{_slashed(settings.concurrencies)} from {source.name}",
             "warm-up": f"{args.warmup} untimed request(s) per method, excluded",
             "rounds": f"up to {args.rounds} per level, methods in turn",
             **_stack_shown(args)}
    text = report.serve_report(summaries, report.header_line("serve", created, machine, git, shown))
    results.write_json(run_dir / "results.json", {
        "kind": "serve", "created": created, "machine": machine, "git": git,
        # JSON has no infinity: a closed loop is written as rate null
        "settings": {**asdict(settings), "request_rate": None if closed_loop else args.request_rate,
                     "model": args.model, "dtype": args.dtype, "threads": threads, "prompts_file": str(source),
                     "gateway": args.gateway or "started by the bench"},
        "definitions": stats.__doc__, "summaries": summaries, "records": [r.to_json() for r in records]})
    (run_dir / "report.md").write_text(text + "\n")
    plots.plot_serving(summaries, run_dir / "serving_vs_concurrency.png")
    print(text)
