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
`layers.0.*` named as in a Llama checkpoint, `draft_vocab`: the target token id of each draft id).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from engine.attention import PagedAttention
from engine.config import EngineConfig
from engine.linear_cpu import shared_runs
from engine.llama import LlamaModel
from engine.runner import ModelRunner, SequenceInput

CONFIG_FILE = "eagle_config.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    draft_vocab_size: int
    target: str = ""  # the model the head was trained for

    @classmethod
    def for_target(cls, target: LlamaConfig, draft_vocab_size: int, target_name: str = "") -> EagleConfig:
        """A head shaped like one of the target's layers."""
        head_dim = getattr(target, "head_dim", None) or target.hidden_size // target.num_attention_heads
        rope_theta = (getattr(target, "rope_parameters", None) or {}).get("rope_theta") or target.rope_theta
        return cls(target.hidden_size, target.intermediate_size, target.num_attention_heads,
                   target.num_key_value_heads, head_dim, target.rms_norm_eps, float(rope_theta),
                   target.max_position_embeddings, draft_vocab_size, target_name)

    def layer_config(self, vocab_size: int) -> LlamaConfig:
        """The one decoder layer as a one-layer Llama config."""
        return LlamaConfig(vocab_size=vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_hidden_layers=1,
                           num_attention_heads=self.num_attention_heads,
                           num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                           rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                           max_position_embeddings=self.max_position_embeddings)

    def save(self, directory: Path) -> None:
        (directory / CONFIG_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path) -> EagleConfig:
        return cls(**json.loads((Path(directory) / CONFIG_FILE).read_text()))


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
        super().__init__(config.layer_config(target_embed.shape[0]), state, engine)
        self.eagle_config = config
        self.fc = self.linear.prepare(head_state["fc.weight"].to(device=engine.device, dtype=engine.dtype))  # [D, 2D]
        self.draft_vocab = draft_vocab.to(engine.device)  # [V'] target token ids

    @classmethod
    def from_pretrained(cls, head_dir: str | Path, target_dir: str | Path,  # type: ignore[override]
                        engine: EngineConfig = EngineConfig()) -> EagleHead:
        """The head in `head_dir`, with the embedding and LM head of the target model in `target_dir`."""
        return cls(EagleConfig.load(Path(head_dir)), load_file(Path(head_dir) / WEIGHTS_FILE),
                   *target_embedding_and_lm_head(target_dir), engine)

    def draft(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
              attention: PagedAttention, logit_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pairs (x_{p+1}, f_p): input_ids [T], features [T, D], positions [T] (p) -> fp32 logits over the
        draft vocabulary [R, V'] of the rows `logit_rows`, and the estimated next features g [T, D]."""
        x = torch.cat([self.embedding(input_ids), features.to(self.embed.dtype)], dim=-1)  # [T, 2D]
        g = self.final_hidden(self.linear.by_rows(x, self.fc, attention.matmul_rows), positions, attention)
        rows = g[logit_rows]
        return self.linear.by_rows(rows, self.lm_head, shared_runs(0, rows.shape[0])).float(), g


class EagleRunner(ModelRunner):
    """The head on its own paged KV cache, batched like the target: a sequence's rows are its pairs
    (x_{p+1}, f_p) at positions p (SequenceInput.token_ids holds the x_{p+1})."""

    def __init__(self, head_dir: str | Path, target_dir: str | Path, kv_cache_tokens: int = 65536,
                 block_size: int = 16, num_threads: int | None = None, engine: EngineConfig = EngineConfig()):
        # Not ModelRunner.__init__, which would load the whole target: only its embedding and LM head.
        self._serve(lambda: EagleHead.from_pretrained(head_dir, target_dir, engine), engine, num_threads,
                    kv_cache_tokens, block_size)

    def draft(self, batch: list[SequenceInput], features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over every sequence's new pairs, features [T, D] in batch order: fp32 logits over the
        draft vocabulary [sum(num_logits), V'] and the estimated next features g [T, D]."""
        attention, input_ids, positions, logit_rows = self._plan(batch)
        with torch.inference_mode():
            return self.model.draft(input_ids, features.to(self.device), positions, attention, logit_rows)
