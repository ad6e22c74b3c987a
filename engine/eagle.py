"""An EAGLE head (Li et al., EAGLE: speculative sampling requires rethinking feature uncertainty).

The target's feature f_p (its final-normed hidden state at position p, which its LM head turns into the
next token's logits) and the embedding of the token x_{p+1} that followed go through one linear layer
(`fc`, [embedding ; feature] -> D) and one Llama decoder layer; the output g_p estimates the target's
next feature f_{p+1}, and the target's own LM head turns it into logits for x_{p+2}. Drafting goes on
from g_p as if it were a feature. The head attends over its own KV cache (position p for the pair
(x_{p+1}, f_p)), so one new pair costs one row.

The LM head is the target's, cut to a draft vocabulary (EAGLE-3's d2t): the target tokens the head
may propose, most frequent first. On a small model the full vocabulary would be most of the head's
cost. Files in a head directory: `eagle_config.json` (`EagleConfig`) and `model.safetensors` (`fc.weight`,
`layers.0.*` named as in a Llama checkpoint, `draft_vocab`: the target token id of each draft id); or a
head as EAGLE's authors publish them (`engine.eagle_checkpoints`; EAGLE-3's run as `engine.eagle3`).
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from engine.attention import PagedAttention
from engine.config import EngineConfig
from engine.eagle_checkpoints import read_head
from engine.eagle3 import Eagle3Head
from engine.eagle_config import WEIGHTS_FILE, EagleConfig
from engine.linear_cpu import shared_runs
from engine.llama import LlamaModel
from engine.runner import ModelRunner, SequenceInput

__all__ = ["EagleConfig", "EagleHead", "EagleRunner", "WEIGHTS_FILE", "load_head", "save_head",
           "target_embedding_and_lm_head"]


def target_embedding_and_lm_head(target_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's token embedding [V, D] and LM head [V, D] (the same tensor where they are tied)."""
    target: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(target_dir).glob("*.safetensors")):
        target.update({name.removeprefix("model."): t for name, t in load_file(shard).items()
                       if name.removeprefix("model.") in ("embed_tokens.weight", "lm_head.weight")})
    embed = target["embed_tokens.weight"]
    return embed, target.get("lm_head.weight", embed)


def save_head(directory: str | Path, config: EagleConfig, state: dict[str, torch.Tensor],
              dtype: torch.dtype | None = None) -> None:
    """A head directory `EagleHead.from_pretrained` loads: `state` as EagleHeadModule.inference_state gives it,
    its weights in `dtype` (None: as they are; bf16 halves a shipped head)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config.save(directory)
    if dtype is not None:
        state = {name: t.to(dtype) if t.is_floating_point() else t for name, t in state.items()}
    save_file(state, directory / WEIGHTS_FILE)


class EagleHead(LlamaModel):
    """The head for inference on a paged KV cache: a one-layer LlamaModel whose input is fc([embedding ;
    feature]) and whose LM head is the target's at the draft vocabulary's rows."""

    def __init__(self, config: EagleConfig, head_state: dict[str, torch.Tensor], target_embed: torch.Tensor,
                 target_lm_head: torch.Tensor, engine: EngineConfig = EngineConfig()):
        draft_vocab = head_state["draft_vocab"].long()
        state = {name: t for name, t in head_state.items() if name.startswith("layers.0.")}
        state.update({"embed_tokens.weight": target_embed, "lm_head.weight": target_lm_head[draft_vocab],
                      "norm.weight": torch.ones(config.hidden_size)})  # no final norm: g_p is a feature already
        if not config.input_norm:  # a placeholder the layer never reads (see _first_layer_input)
            state["layers.0.input_layernorm.weight"] = torch.ones(config.hidden_size)
        super().__init__(config.layer_config(target_embed.shape[0]), state, engine)
        self.eagle_config = config
        self.fc = self.linear.prepare(head_state["fc.weight"].to(device=engine.device, dtype=engine.dtype))  # [D, 2D]
        self.fc_bias = head_state["fc.bias"].to(device=engine.device, dtype=engine.dtype) if config.fc_bias else None
        self.draft_vocab = draft_vocab.to(engine.device)  # [V'] target token ids

    def draft(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
              attention: PagedAttention, logit_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pairs (x_{p+1}, f_p): input_ids [T], features [T, D], positions [T] (p) -> fp32 logits over the
        draft vocabulary [R, V'] of the rows `logit_rows`, and the estimated next features g [T, D]."""
        x = torch.cat([self.embedding(input_ids), features.to(self.embed.dtype)], dim=-1)  # [T, 2D]
        h = self.linear.by_rows(x, self.fc, attention.matmul_rows)
        if self.fc_bias is not None:
            h += self.fc_bias
        g = self.final_hidden(h, positions, attention)
        rows = g[logit_rows]
        return self.linear.by_rows(rows, self.lm_head, shared_runs(0, rows.shape[0])).float(), g

    def _first_layer_input(self, h: torch.Tensor) -> torch.Tensor:
        return super()._first_layer_input(h) if self.eagle_config.input_norm else h


def load_head(head_dir: str | Path, target_dir: str | Path,
              engine: EngineConfig = EngineConfig()) -> EagleHead | Eagle3Head:
    """The head in `head_dir` (trained here, or published by EAGLE's authors: EAGLE-1/2 or EAGLE-3), with the
    embedding (and for EAGLE-1/2 the LM head) of the target model in `target_dir`."""
    embed, lm_head = target_embedding_and_lm_head(target_dir)
    config, state = read_head(head_dir, embed.shape[0], AutoConfig.from_pretrained(target_dir).num_hidden_layers)
    if config.hidden_size != embed.shape[1]:
        raise ValueError(f"the EAGLE head in {head_dir} is for a model of hidden size {config.hidden_size}; the "
                         f"target's is {embed.shape[1]}")
    if config.target_layers:
        return Eagle3Head(config, state, embed, engine)
    return EagleHead(config, state, embed, lm_head, engine)


class EagleRunner(ModelRunner):
    """The head on its own paged KV cache, batched like the target: a sequence's rows are its pairs
    (x_{p+1}, f_p) at positions p (SequenceInput.token_ids holds the x_{p+1})."""

    def __init__(self, head_dir: str | Path, target_dir: str | Path, kv_cache_tokens: int = 65536,
                 block_size: int = 16, num_threads: int | None = None, engine: EngineConfig = EngineConfig()):
        # Not ModelRunner.__init__, which would load the whole target: only its embedding and LM head.
        self._serve(lambda: load_head(head_dir, target_dir, engine), engine, num_threads, kv_cache_tokens, block_size)

    def draft(self, batch: list[SequenceInput], features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over every sequence's new pairs, features in batch order ([T, D]; EAGLE-3: [T, 3D] as the
        target sends them, or [T, D] its own estimates): fp32 logits over the draft vocabulary
        [sum(num_logits), V'] and the estimated next features g [T, D]."""
        attention, input_ids, positions, logit_rows = self._plan(batch)
        with torch.inference_mode():
            return self.model.draft(input_ids, features.to(self.device), positions, attention, logit_rows)
