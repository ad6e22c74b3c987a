"""Reading an EAGLE head directory: one `specd train eagle` saved, or one of EAGLE's published heads.

EAGLE-1 and EAGLE-2 heads as their authors publish them (e.g. `yuhuili/EAGLE-llama2-chat-7B`,
`yuhuili/EAGLE-LLaMA3-Instruct-8B`) are a Hugging Face `config.json` of a one-layer Llama and
`pytorch_model.bin` or `model.safetensors` holding `fc.weight` [D, 2D] over [embedding ; feature] (and
`fc.bias` where the head was trained with one) and the layer under `layers.0.`, without
`layers.0.input_layernorm`: EAGLE's first layer takes fc's output as it is. Any `embed_tokens.weight`
there is the target's own, which the head reads from the target instead; its LM head is the target's
over the whole vocabulary. EAGLE-3 heads (`midlayer.`, `d2t`) draft from three of the target's layers,
which the target does not send: they are refused by name.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.eagle_config import CONFIG_FILE, WEIGHTS_FILE, EagleConfig

PUBLISHED_CONFIG = "config.json"
PUBLISHED_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
LAYER_WEIGHTS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight", "mlp.down_proj.weight")


def read_head(directory: str | Path, vocab_size: int) -> tuple[EagleConfig, dict[str, torch.Tensor]]:
    """The head in `directory` for a target of `vocab_size` tokens: its config and its weights under the
    names `EagleHead` loads (`fc.weight`, `fc.bias` if any, `layers.0.*`, `draft_vocab`)."""
    directory = Path(directory)
    if (directory / CONFIG_FILE).exists():
        return EagleConfig.load(directory), load_file(directory / WEIGHTS_FILE)
    if (directory / PUBLISHED_CONFIG).exists():
        return _read_published(directory, vocab_size)
    raise FileNotFoundError(f"{directory} is not an EAGLE head: it has neither {CONFIG_FILE} (a head from "
                            f"`specd train eagle`) nor {PUBLISHED_CONFIG} (an EAGLE-1/EAGLE-2 head as published)")


def _read_published(directory: Path, vocab_size: int) -> tuple[EagleConfig, dict[str, torch.Tensor]]:
    weights = _published_weights(directory)
    if any(name.startswith("midlayer.") for name in weights) or "d2t" in weights:
        raise ValueError(f"{directory} is an EAGLE-3 head (midlayer.*, d2t); the eagle drafter runs EAGLE-1 "
                         "and EAGLE-2 heads, which draft from the target's last layer")
    config = json.loads((directory / PUBLISHED_CONFIG).read_text())
    if config.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{directory}: an EAGLE head of {config['num_hidden_layers']} layers; one is supported")
    if config.get("vocab_size", vocab_size) != vocab_size:
        raise ValueError(f"{directory}: a head for a vocabulary of {config['vocab_size']} tokens; the target has "
                         f"{vocab_size}")
    if config.get("rope_scaling"):
        raise ValueError(f"{directory}: rope_scaling {config['rope_scaling']} is not supported for EAGLE heads")
    missing = [name for name in ("fc.weight", *(f"layers.0.{w}" for w in LAYER_WEIGHTS)) if name not in weights]
    if missing:
        raise ValueError(f"{directory}: not an EAGLE-1/EAGLE-2 head, it lacks {', '.join(missing)}")
    heads = config["num_attention_heads"]
    eagle = EagleConfig(
        hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
        num_attention_heads=heads, num_key_value_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=float(config.get("rope_theta", 10000.0)),
        max_position_embeddings=config.get("max_position_embeddings", 2048), draft_vocab_size=vocab_size,
        target=config.get("_name_or_path", ""), input_norm=False, fc_bias="fc.bias" in weights)
    kept = {name: t for name, t in weights.items() if name.startswith(("fc.", "layers.0."))}
    return eagle, {**kept, "draft_vocab": torch.arange(vocab_size)}


def _published_weights(directory: Path) -> dict[str, torch.Tensor]:
    for name in PUBLISHED_WEIGHTS:
        path = directory / name
        if path.exists():
            return load_file(path) if path.suffix == ".safetensors" else torch.load(path, map_location="cpu",
                                                                                    weights_only=True)
    raise FileNotFoundError(f"{directory}: no head weights ({' or '.join(PUBLISHED_WEIGHTS)})")
