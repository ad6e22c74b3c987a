"""Times every verification kernel: Triton (on CUDA), the PyTorch reference, and a naive per-sequence loop.

Every sequence drafts k tokens (a chain, or a random tree of k nodes); each
implementation's outputs are checked against the reference's before it is
timed. Prints a markdown table (fastest of ≥ 5 calls) for batch sizes x k.

    .venv/bin/python benchmarks/verify_kernels.py [--batches 1,4,16,64,256] [--ks 1,4,16] [--vocab 32000]
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

# Run as a script, this file's folder comes first on sys.path and its name would shadow the package.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from kernels import reference  # noqa: E402
from kernels.dispatch import triton_implementation  # noqa: E402
from kernels.testing import DraftBatch, random_batch, random_kv_moves  # noqa: E402

NUM_KV_POOLS, KV_HEADS, HEAD_DIM = 60, 3, 64  # SmolLM2-135M: 30 layers of K and V, 3 KV heads of 64


@dataclass(frozen=True)
class Case:
    """One kernel: how to build its inputs, and how to run an implementation module or the loop on them."""
    name: str
    make: Callable[[int, int, int, str], object]  # (batch, k, vocab, device) -> inputs
    run: Callable[[object, object], object]  # (implementation module, inputs) -> outputs
    loop: Callable[[object], object]  # inputs -> outputs
    mutates: bool = False  # outputs are the inputs, changed: every run needs fresh ones


# ----- naive per-sequence loops: what the kernels replace -----

def loop_greedy_accept(b: DraftBatch):
    drafts, cu, argmax = b.draft_token_ids.tolist(), b.cu_draft_lens.tolist(), b.target_argmax.tolist()
    num_accepted, next_token = [], []
    for seq in range(b.num_seqs):
        first, row, n = cu[seq], cu[seq] + seq, 0
        while n < cu[seq + 1] - first and drafts[first + n] == argmax[row + n]:
            n += 1
        num_accepted.append(n)
        next_token.append(argmax[row + n])
    return torch.tensor(num_accepted), torch.tensor(next_token)


def loop_rejection_sample(b: DraftBatch, with_draft_probs: bool):
    drafts, cu = b.draft_token_ids.tolist(), b.cu_draft_lens.tolist()
    num_accepted, next_token = [], []
    for seq in range(b.num_seqs):
        first, last, row, n = cu[seq], cu[seq + 1], cu[seq] + seq, 0
        while n < last - first:
            p = b.target_probs[row + n, drafts[first + n]]
            q = b.draft_probs[first + n, drafts[first + n]] if with_draft_probs else 1.0
            if bool(b.uniform_accept[first + n] * q >= p):
                break
            n += 1
        num_accepted.append(n)
        next_token.append(int(reference.sample_recovered(
            b.draft_token_ids[first:last], torch.tensor([0, last - first]), b.target_probs[row:row + last - first + 1],
            b.draft_probs[first:last] if with_draft_probs else None, torch.tensor([n]), b.uniform_final[seq:seq + 1])))
    return torch.tensor(num_accepted), torch.tensor(next_token)


def loop_tree_greedy_accept(b: DraftBatch):
    drafts, parents = b.draft_token_ids.tolist(), b.parent_ids.tolist()
    cu, argmax = b.cu_draft_lens.tolist(), b.target_argmax.tolist()
    num_accepted, accepted_nodes, next_token = [], [], []
    for seq in range(b.num_seqs):
        first, n, root_row = cu[seq], cu[seq + 1] - cu[seq], cu[seq] + seq
        depth = [0] * n  # 0: not accepted
        for i in range(n):
            parent = parents[first + i]
            if (parent < 0 or depth[parent]) and drafts[first + i] == argmax[root_row + 1 + parent]:
                depth[i] = 1 + (depth[parent] if parent >= 0 else 0)
        best = max((i for i in range(n) if depth[i]), key=lambda i: (depth[i], -i), default=-1)
        path, node = [], best
        while node >= 0:
            path.insert(0, node)
            node = parents[first + node]
        num_accepted.append(len(path))
        accepted_nodes += path + [-1] * (n - len(path))
        next_token.append(argmax[root_row + 1 + (path[-1] if path else -1)])
    return torch.tensor(num_accepted), torch.tensor(accepted_nodes, dtype=torch.int64), torch.tensor(next_token)


def loop_build_tree_attention(b: DraftBatch):
    parents, cu, starts = b.parent_ids.tolist(), b.cu_draft_lens.tolist(), b.start_positions.tolist()
    positions, masks = [], []
    for seq in range(b.num_seqs):
        first, n = cu[seq], cu[seq + 1] - cu[seq]
        row_parent = [-1] + [parents[first + i] + 1 for i in range(n)]  # rows: the root, then node i at 1 + i
        ancestors = [{0}]
        for row in range(1, n + 1):
            ancestors.append(ancestors[row_parent[row]] | {row})
        positions += [starts[seq] + len(rows) - 1 for rows in ancestors]
        masks.append(torch.tensor([[j in ancestors[i] for j in range(n + 1)] for i in range(n + 1)]).flatten())
    return torch.tensor(positions), torch.cat(masks)


def loop_compact_kv(moves):
    pools, src_slots, dst_slots = moves
    # Path entries only move down (dst < src, both increasing), so one move at a time is safe.
    for src, dst in zip(src_slots.tolist(), dst_slots.tolist()):
        for pool in pools:
            pool[dst] = pool[src]
    return pools


def run_compact_kv(impl, moves):
    impl.compact_kv(*moves)
    return moves[0]


def chains(batch, k, vocab, device):
    return random_batch([k] * batch, vocab, device=device)


def trees(batch, k, vocab, device):
    return random_batch([k] * batch, 64, tree=True, device=device)  # argmax only: the vocabulary does not matter


def kv_moves(batch, k, vocab, device):
    return random_kv_moves([k] * batch, NUM_KV_POOLS, KV_HEADS, HEAD_DIM, device=device)


CASES = [
    Case("greedy_accept", chains,
         lambda impl, b: impl.greedy_accept(b.draft_token_ids, b.cu_draft_lens, b.target_argmax), loop_greedy_accept),
    Case("rejection_sample, q=1", chains,
         lambda impl, b: impl.rejection_sample(b.draft_token_ids, b.cu_draft_lens, b.target_probs, None,
                                               b.uniform_accept, b.uniform_final),
         lambda b: loop_rejection_sample(b, with_draft_probs=False)),
    Case("rejection_sample, draft probs", chains,
         lambda impl, b: impl.rejection_sample(b.draft_token_ids, b.cu_draft_lens, b.target_probs, b.draft_probs,
                                               b.uniform_accept, b.uniform_final),
         lambda b: loop_rejection_sample(b, with_draft_probs=True)),
    Case("tree_greedy_accept", trees,
         lambda impl, b: impl.tree_greedy_accept(b.draft_token_ids, b.parent_ids, b.cu_draft_lens, b.target_argmax),
         loop_tree_greedy_accept),
    Case("build_tree_attention", trees,
         lambda impl, b: impl.build_tree_attention(b.parent_ids, b.cu_draft_lens, b.start_positions),
         loop_build_tree_attention),
    Case(f"compact_kv, {NUM_KV_POOLS} pools", kv_moves, run_compact_kv, loop_compact_kv, mutates=True),
]


def implementations(device: torch.device) -> dict[str, Callable[[Case, object], object]]:
    """name -> run(case, inputs): Triton where it runs natively, the reference, the loop."""
    runs = {}
    triton_impl = triton_implementation()
    if triton_impl is not None and device.type == "cuda":
        runs["triton"] = lambda case, inputs: case.run(triton_impl, inputs)
    runs["reference"] = lambda case, inputs: case.run(reference, inputs)
    runs["loop"] = lambda case, inputs: case.loop(inputs)
    return runs


def best_seconds(call: Callable[[], object], device: torch.device, min_seconds: float) -> float:
    """Fastest wall time of call() over enough repetitions to fill min_seconds (at least 5).

    The fastest, not the median: on a shared machine the other processes only ever add time.
    """
    call()  # warm-up: Triton compiles on its first call
    times = []
    while len(times) < 5 or sum(times) < min_seconds:
        _synchronize(device)
        start = time.perf_counter()
        call()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_same(name: str, got, want) -> None:
    got, want = (got, want) if isinstance(want, (tuple, list)) else ((got,), (want,))
    for g, w in zip(got, want, strict=True):
        if not torch.equal(g.cpu(), w.cpu()):
            raise AssertionError(f"{name}: outputs differ from the reference's")


def time_case(case: Case, batch: int, k: int, vocab: int, device: torch.device,
              runs: dict[str, Callable], min_seconds: float) -> dict[str, float]:
    """Seconds per call for each implementation, after checking its outputs against the reference's."""
    inputs = case.make(batch, k, vocab, device)
    fresh = (lambda: case.make(batch, k, vocab, device)) if case.mutates else (lambda: inputs)
    expected = runs["reference"](case, fresh())
    seconds = {}
    for name, run in runs.items():
        check_same(f"{case.name} ({name})", run(case, fresh()), expected)
        seconds[name] = best_seconds(lambda: run(case, inputs), device, min_seconds)
    return seconds


def _triton_version() -> str:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor() or "CPU")
    return f"{model}, {torch.get_num_threads()} threads"


def markdown_table(rows: list[tuple[str, int, int, dict[str, float]]], names: list[str]) -> str:
    header = ["kernel", "batch", "k", *(f"{name} µs" for name in names), "loop ÷ reference"]
    if "triton" in names:
        header.append("reference ÷ triton")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for kernel, batch, k, seconds in rows:
        cells = [kernel, str(batch), str(k), *(f"{seconds[name] * 1e6:,.0f}" for name in names),
                 f"{seconds['loop'] / seconds['reference']:.1f}×"]
        if "triton" in names:
            cells.append(f"{seconds['reference'] / seconds['triton']:.1f}×")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,4,16,64,256", help="batch sizes, comma-separated")
    parser.add_argument("--ks", default="1,4,16", help="draft tokens (tree nodes) per sequence, comma-separated")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary of the sampling kernels")
    parser.add_argument("--min-seconds", type=float, default=0.2, help="least time spent timing each cell")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    runs = implementations(device)
    rows = []
    for case in CASES:
        for batch in map(int, args.batches.split(",")):
            for k in map(int, args.ks.split(",")):
                rows.append((case.name, batch, k, time_case(case, batch, k, args.vocab, device, runs,
                                                            args.min_seconds)))
    print(f"## Verification kernels on {device_name(device)}\n")
    print(f"{datetime.date.today().isoformat()} · torch {torch.__version__} · "
          f"triton {_triton_version()} · "
          f"vocab {args.vocab} (sampling kernels) · fastest of ≥ 5 calls · every output checked "
          f"against the reference's\n")
    print(markdown_table(rows, list(runs)))


if __name__ == "__main__":
    main()
