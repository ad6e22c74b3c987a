"""What bounding oneDNN's caches costs: the matmuls of a forward (every layer's weight shapes, the model's
own, and the LM head over 8 rows) through `onednn_linear`, one step per row count in turn, 40 row counts
(as under load, where every step has its own), at each cache capacity in a fresh process.

    .venv/bin/python benchmarks/onednn_cache.py [--model DIR] [--capacities 32,1024] [--threads 2]

At capacity 32 every step misses (40 row counts in turn); at 1,024 every step hits after the first pass.
Prints the best of 3 passes' mean ms per step and the process's RssAnon after them.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROW_COUNTS = range(17, 217, 5)


def run_one(model: str, threads: int) -> None:
    import torch
    from transformers import AutoConfig

    import engine.linear_cpu as linear
    from specd.model_store import resolve_model

    config = AutoConfig.from_pretrained(resolve_model(model))
    hidden, inner = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (hidden // config.num_attention_heads)
    torch.set_num_threads(threads)
    assert linear.onednn_available(), "this torch build has no oneDNN"
    layer = [torch.randn(n, k) for n, k in
             [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inner, hidden), (inner, hidden),
              (hidden, inner)]]
    head = torch.randn(config.vocab_size, hidden)

    def mean_step_ms() -> float:
        started = time.perf_counter()
        for rows in ROW_COUNTS:
            inputs = {hidden: torch.randn(rows, hidden), inner: torch.randn(rows, inner)}
            for _ in range(config.num_hidden_layers):
                for weight in layer:
                    linear.onednn_linear(inputs[weight.shape[1]], weight)
            linear.onednn_linear(inputs[hidden][-8:], head)
        return (time.perf_counter() - started) / len(ROW_COUNTS) * 1e3

    mean_step_ms()  # first pass: every shape is new at any capacity
    best = min(mean_step_ms() for _ in range(3))
    anon_kib = next(line for line in open("/proc/self/status") if line.startswith("RssAnon")).split()[1]
    print(f"capacity {os.environ['LRU_CACHE_CAPACITY']:>5}: {best:7.1f} ms per step, "
          f"RssAnon {int(anon_kib) // 1024} MiB", flush=True)


def main() -> None:
    from specd.model_store import DEFAULT_MODEL

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--capacities", default="32,1024")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one capacity
    args = parser.parse_args()
    if args.one:
        run_one(args.model, args.threads)
        return
    for capacity in args.capacities.split(","):
        env = {**os.environ, "LRU_CACHE_CAPACITY": capacity, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": capacity}
        subprocess.run([sys.executable, __file__, "--one", "--model", args.model, "--threads", str(args.threads)],
                       env=env, check=True)


if __name__ == "__main__":
    main()
