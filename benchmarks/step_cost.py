"""Time one target forward over N new tokens at a fixed cached context: specd vs transformers.

    .venv/bin/python benchmarks/step_cost.py [--model DIR] [--context 1000] [--repeats 15] [--threads N]
        [--dtypes float32,bfloat16] [--batch-sizes 1,8,32]

Both sides run the same weights in the same dtype on the same threads and return logits for
every new token (what a verification step needs). transformers runs
LlamaForCausalLM with a DynamicCache prefilled to the context and cropped back
after every timed call; specd runs its ModelRunner and truncates the same way.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from specd.model_store import DEFAULT_MODEL, resolve_model
from engine.config import EngineConfig
from engine.runner import ModelRunner, SequenceInput

NEW_TOKENS = (1, 2, 4, 8, 16, 32)
WARMUP = 2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model directory, .gguf file or known name")
    parser.add_argument("--context", type=int, default=1000, help="tokens already cached per sequence")
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per point (median reported)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtypes", type=lambda t: t.split(","), default=["float32", "bfloat16"],
                        help="comma-separated, one table each (default float32,bfloat16)")
    parser.add_argument("--batch-sizes", type=lambda t: [int(b) for b in t.split(",")], default=[1, 8, 32],
                        help="sequences per step, comma-separated (default 1,8,32)")
    return parser.parse_args()


def median_ms_each(sides: list, new_tokens: torch.Tensor, repeats: int) -> list[float]:
    """Median wall time in ms of each side's step; calls alternate between the sides so that
    drift in the machine's speed hits them alike. The rollback after each call is untimed."""
    times = [[] for _ in sides]
    for i in range(WARMUP + repeats):
        for side, side_times in zip(sides, times):
            start = time.perf_counter()
            side.step(new_tokens)
            elapsed = time.perf_counter() - start
            side.rollback()
            if i >= WARMUP:
                side_times.append(elapsed * 1000)
    return [statistics.median(t) for t in times]


class SpecdSide:
    def __init__(self, model_dir, prompts: torch.Tensor, threads: int, engine: EngineConfig):
        batch, context = prompts.shape
        self.context = context
        block_size = 16
        self.runner = ModelRunner(model_dir, kv_cache_tokens=batch * (context + max(NEW_TOKENS) + block_size),
                                  block_size=block_size, num_threads=threads, engine=engine)
        self.seq_ids = [f"seq{i}" for i in range(batch)]
        self.runner.forward([SequenceInput(s, p.tolist(), 0, 1) for s, p in zip(self.seq_ids, prompts)])

    def step(self, new_tokens: torch.Tensor) -> None:
        """new_tokens [B, n]: logits for all n of each of the first B sequences."""
        self.runner.forward([SequenceInput(s, t.tolist(), self.context, len(t))
                             for s, t in zip(self.seq_ids, new_tokens)])

    def rollback(self) -> None:
        for s in self.seq_ids:
            self.runner.allocator.truncate(s, self.context)


class HFSide:
    def __init__(self, model_dir, prompts: torch.Tensor, dtype: torch.dtype, batch_sizes: list[int]):
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.context = prompts.shape[1]
        # One cache per batch size.
        self.caches = {size: self._prefill(prompts[:size]) for size in batch_sizes}
        self.active = self.caches[batch_sizes[0]]

    def _prefill(self, prompts: torch.Tensor) -> DynamicCache:
        cache = DynamicCache(config=self.model.config)
        with torch.inference_mode():
            self.model(input_ids=prompts, past_key_values=cache, use_cache=True)
        return cache

    def step(self, new_tokens: torch.Tensor) -> None:
        self.active = self.caches[new_tokens.shape[0]]
        with torch.inference_mode():
            self.model(input_ids=new_tokens, past_key_values=self.active, use_cache=True)

    def rollback(self) -> None:
        # A negative crop removes that many tokens (the form every transformers version accepts).
        self.active.crop(self.context - self.active.get_seq_length())


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 1000, (max(args.batch_sizes), args.context), generator=gen)  # [B, context]
    print(f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}\n- cpu: {cpu_model()}\n"
          f"- torch: {torch.__version__}, threads: {torch.get_num_threads()}\n"
          f"- model: {model_dir.name}, context: {args.context} cached tokens per sequence\n"
          f"- median of {args.repeats} calls after {WARMUP} warm-up, specd and HF alternating; "
          f"ratio = specd / HF")
    for dtype_name in args.dtypes:
        engine = EngineConfig.parse("cpu", dtype_name)
        specd = SpecdSide(model_dir, prompts, args.threads, engine)
        hf = HFSide(model_dir, prompts, engine.dtype, args.batch_sizes)
        print(f"\n{engine.dtype_name}:\n")
        print("| new tokens | " + " | ".join(f"specd {b} seq ms | HF {b} seq ms | ratio" for b in args.batch_sizes) + " |")
        print("|---:|" + "---:|---:|---:|" * len(args.batch_sizes))
        for n in NEW_TOKENS:
            cells = [str(n)]
            for size in args.batch_sizes:
                new_tokens = torch.randint(0, 1000, (size, n), generator=gen)  # [B, n]
                ours, theirs = median_ms_each([specd, hf], new_tokens, args.repeats)
                cells += [f"{ours:.1f}", f"{theirs:.1f}", f"{ours / theirs:.2f}"]
            print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
