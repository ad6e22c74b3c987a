"""What a user would run instead: transformers' `generate`, plain greedy/sampled
("hf") and its prompt-lookup mode ("hf-lookup"), on the same model, prompts,
threads and token budget, timed per streamed step like a specd request."""
from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

from specd_cli.bench.prompts import Prompt
from specd_cli.bench.records import BASELINE_SYSTEMS, RequestRecord


class _StepTimer(BaseStreamer):
    """generate() hands the streamer the prompt first, then each forward pass's new tokens."""

    def __init__(self):
        self.start = time.perf_counter()
        self.chunks: list[tuple[float, int]] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.chunks.append((time.perf_counter() - self.start, value.numel()))
        self._prompt_seen = True

    def end(self) -> None:
        pass


class TransformersBaselines:
    def __init__(self, model_dir: Path, threads: int, prompt_lookup_num_tokens: int = 10,
                 dtype: torch.dtype = torch.float32):
        torch.set_num_threads(threads)  # the target's threads, so both sides get the same cores
        self.prompt_lookup_num_tokens = prompt_lookup_num_tokens
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()  # the target's dtype

    def run(self, baseline: str, prompt: Prompt, temperature: float, seed: int | None,
            max_tokens: int) -> RequestRecord:
        if baseline not in BASELINE_SYSTEMS:
            raise ValueError(f"unknown baseline {baseline!r}; known: {', '.join(BASELINE_SYSTEMS)}")
        record = RequestRecord(baseline, prompt.prompt_id, prompt.category, temperature, seed, max_tokens)
        timer = _StepTimer()  # started before tokenizing: a specd request's time includes the gateway's
        # The same rendering as the gateway's: chat template, generation prompt, no extra special tokens.
        inputs = self.tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True,
                                                    return_tensors="pt", return_dict=True)
        record.prompt_tokens = inputs["input_ids"].shape[1]
        kwargs = self._sampling_kwargs(temperature, seed)
        if baseline == "hf-lookup":
            kwargs["prompt_lookup_num_tokens"] = self.prompt_lookup_num_tokens
        output = self.model.generate(**inputs, max_new_tokens=max_tokens, streamer=timer, **kwargs)
        record.e2e_s = time.perf_counter() - timer.start
        record.token_ids = output[0, record.prompt_tokens:].tolist()
        record.chunks = timer.chunks
        record.verification_steps = len(timer.chunks) - 1  # the first chunk is the prefill's
        record.text = self.tokenizer.decode(record.token_ids, skip_special_tokens=True)
        stopped = record.token_ids and record.token_ids[-1] in _eos_ids(self.model)
        record.finish_reason = "stop" if stopped else "length"
        return record

    @staticmethod
    def _sampling_kwargs(temperature: float, seed: int | None) -> dict:
        if temperature == 0:
            return {"do_sample": False}
        if seed is not None:
            torch.manual_seed(seed)
        # top_k=0 and top_p=1 switch off transformers' default top-k of 50: plain temperature sampling, as specd's.
        return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


def _eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])
