"""The target run by transformers, to prepare training data on a GPU (`--prepare-with transformers`).

specd's engine answers `data.ANSWER_BATCH` (32) conversations one token a forward; transformers' `generate`
answers GENERATE_BATCH at once (on an H200: 1.45M tokens of answers and features in 260 s). The features
are the same quantity either way: the final-normed hidden state of every token (the Llama model's
`last_hidden_state`, which the LM head turns into the next token's logits).
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

GENERATE_BATCH = 512  # conversations answered at once


class TransformersTarget:
    def __init__(self, model_dir: str | Path, device: str, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos_token_ids = frozenset(eos if isinstance(eos, list) else [eos])
        self.device = device

    @torch.inference_mode()
    def answers(self, prompts: list[list[int] | None], max_new_tokens: int) -> Iterator[list[int]]:
        """Each prompt followed by its greedy answer, up to and with its end-of-sequence token (an empty
        list for None)."""
        live = [i for i, p in enumerate(prompts) if p]
        texts = [list(p) if p else [] for p in prompts]
        if live:
            pad = min(self.eos_token_ids)
            width = max(len(prompts[i]) for i in live)
            ids = torch.full((len(live), width), pad, dtype=torch.long)
            mask = torch.zeros((len(live), width), dtype=torch.long)
            for row, i in enumerate(live):  # padded on the left: every answer starts at column `width`
                ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
                mask[row, width - len(prompts[i]):] = 1
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
                                      eos_token_id=sorted(self.eos_token_ids))
            for row, i in enumerate(live):
                for token in out[row, width:].tolist():
                    texts[i].append(token)
                    if token in self.eos_token_ids:
                        break
        yield from texts

    @torch.inference_mode()
    def features(self, ids: list[int]) -> torch.Tensor:
        """The target's feature of every token of `ids` [n, D], bf16."""
        hidden = self.model.model(input_ids=torch.tensor([ids], device=self.device)).last_hidden_state[0]
        return hidden.to(torch.bfloat16).cpu()
