"""`specd bench soak`: start a supervised stack on free ports, soak it, print the report (and write it as JSON);
exit status 1 if the stack did not hold."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from specd.model_store import DEFAULT_MODEL
from specd_cli.bench.prompts import DEFAULT_SPEC_BENCH
from specd_cli.signals import interrupt_on_sigterm
from specd_cli.soak.settings import SoakSettings

DEFAULTS = SoakSettings()


def register(kinds: argparse._SubParsersAction) -> None:
    soak = kinds.add_parser("soak", help="long steady load with a drafter killed and a cancel storm inside it",
                            description="N clients back to back for a warm-up and then the measured part, in which "
                                        "a drafter is SIGKILLed (the supervisor restarts it) and a storm of streams "
                                        "is cancelled after their first tokens. Holds if no request is lost but the "
                                        "cancelled ones, the resident memory of the target and of the drafters that "
                                        "lived through it moved at most --rss-tolerance, and the KV cache and every "
                                        "drafter are back to idle once the load has drained.")
    soak.add_argument("--clients", type=int, default=DEFAULTS.clients, help=f"(default {DEFAULTS.clients})")
    soak.add_argument("--duration", type=float, default=DEFAULTS.duration_s, metavar="SECONDS",
                      help=f"the measured part, after the warm-up (default {DEFAULTS.duration_s:g})")
    soak.add_argument("--warm-up", type=float, default=DEFAULTS.warm_up_s, metavar="SECONDS",
                      help=f"the same load before the memory baseline (default {DEFAULTS.warm_up_s:g})")
    soak.add_argument("--warm-up-requests", type=int, default=DEFAULTS.warm_up_requests_per_client, metavar="N",
                      help="and until N requests per client have completed "
                           f"(default {DEFAULTS.warm_up_requests_per_client})")
    soak.add_argument("--kill", default=DEFAULTS.kill, metavar="SERVICE",
                      help=f"the service to SIGKILL, '' for none (default {DEFAULTS.kill})")
    soak.add_argument("--kill-at", type=float, default=None, metavar="SECONDS",
                      help="into the measured part (default: a third of the way in)")
    soak.add_argument("--storm-streams", type=int, default=DEFAULTS.storm_streams,
                      help=f"streams in the cancel storm, 0 for none (default {DEFAULTS.storm_streams})")
    soak.add_argument("--storm-at", type=float, default=None, metavar="SECONDS",
                      help="into the measured part (default: two thirds of the way in)")
    soak.add_argument("--max-tokens", type=int, default=DEFAULTS.max_tokens,
                      help=f"a request asks for a quarter of this up to this (default {DEFAULTS.max_tokens})")
    soak.add_argument("--rss-tolerance", type=float, default=DEFAULTS.rss_tolerance, metavar="FRACTION",
                      help=f"most change of resident memory, up or down (default {DEFAULTS.rss_tolerance:g})")
    soak.add_argument("--suffix-cached-requests", type=int, default=DEFAULTS.suffix_cached_requests, metavar="N",
                      help="the suffix drafter's --max-cached-requests: a bound the warm-up reaches, so that its "
                           f"memory must be flat after it (default {DEFAULTS.suffix_cached_requests})")
    soak.add_argument("--trie-nodes", type=int, default=DEFAULTS.trie_nodes, metavar="N",
                      help=f"the trie drafter's --max-trie-nodes, likewise (default {DEFAULTS.trie_nodes})")
    soak.add_argument("--prompts", type=Path, default=DEFAULT_SPEC_BENCH,
                      help="Spec-Bench JSONL (default: the shipped question.jsonl)")
    soak.add_argument("--model", default=DEFAULT_MODEL, help=f"(default {DEFAULT_MODEL})")
    soak.add_argument("--threads", type=int, default=None, help="torch threads of each service (default torch's)")
    soak.add_argument("--seed", type=int, default=DEFAULTS.seed, help=f"(default {DEFAULTS.seed})")
    soak.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the report here")
    soak.set_defaults(run=run_soak)


def run_soak(args: argparse.Namespace) -> int:
    from specd_cli.bench.deployment import served_methods
    from specd_cli.bench.prompts import load_spec_bench
    from specd_cli.soak.driver import soak, soak_stack, supervised

    settings = SoakSettings(clients=args.clients, warm_up_s=args.warm_up,
                            warm_up_requests_per_client=args.warm_up_requests, duration_s=args.duration,
                            kill=args.kill or None, kill_at_s=args.kill_at, storm_streams=args.storm_streams,
                            storm_at_s=args.storm_at, max_tokens=args.max_tokens, rss_tolerance=args.rss_tolerance,
                            seed=args.seed, suffix_cached_requests=args.suffix_cached_requests,
                            trie_nodes=args.trie_nodes)
    prompts = load_spec_bench(args.prompts)
    stack = soak_stack(settings, model=args.model, threads=args.threads)
    if settings.kill and settings.kill not in stack.services:
        print(f"specd bench soak: no service {settings.kill} (there are: {', '.join(stack.services)})", file=sys.stderr)
        return 2
    interrupt_on_sigterm()
    with supervised(stack):
        report = asyncio.run(soak(stack, settings, prompts, served_methods(stack.address("target"))))
    print(report.text())
    if args.json:
        args.json.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return 1 if report.failures() else 0
