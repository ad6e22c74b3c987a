"""Reading an EAGLE head directory: one `specd train eagle` saved, or one of EAGLE's published heads.

EAGLE-1 and EAGLE-2 heads as their authors publish them (e.g. `yuhuili/EAGLE-llama2-chat-7B`,
`yuhuili/EAGLE-LLaMA3-Instruct-8B`) are a Hugging Face `config.json` of a one-layer Llama and
`pytorch_model.bin` or `model.safetensors` holding `fc.weight` [D, 2D] over [embedding ; feature] (and
`fc.bias` where the head was trained with one) and the layer under `layers.0.`, without
`layers.0.input_layernorm`: EAGLE's first layer takes fc's output as it is. Any `embed_tokens.weight`
there is the target's own, which the head reads from the target instead; its LM head is the target's
over the whole vocabulary.

EAGLE-3 heads (e.g. `yuhuili/EAGLE3-LLaMA3.1-Instruct-8B`) hold `fc.weight` [D, 3D] over three target layers'
inputs, the layer under `midlayer.` (with a `hidden_norm` beside its input norm, and attention over [2D]),
their own `norm.weight` and `lm_head.weight` over the draft vocabulary, and `d2t` (each draft token's offset
to its target token). The layers are `eagle_aux_hidden_state_layer_ids` where the config names them, else
EAGLE-3's: 2, the middle one and the third from last.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.eagle_config import CONFIG_FILE, WEIGHTS_FILE, EagleConfig

PUBLISHED_CONFIG = "config.json"
PUBLISHED_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
EAGLE3_WEIGHTS = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "midlayer.input_layernorm.weight",
                  "midlayer.hidden_norm.weight")
LAYER_WEIGHTS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight", "mlp.down_proj.weight")


def read_head(directory: str | Path, vocab_size: int,
              target_layers: int) -> tuple[EagleConfig, dict[str, torch.Tensor]]:
    """The head in `directory` for a target of `vocab_size` tokens and `target_layers` layers: its config and
    its weights under the names `EagleHead` (`Eagle3Head`) loads: `fc.weight`, `fc.bias` if any, `layers.0.*`,
    `draft_vocab` (and `norm.weight`, `lm_head.weight`)."""
    directory = Path(directory)
    if (directory / CONFIG_FILE).exists():
        return EagleConfig.load(directory), load_file(directory / WEIGHTS_FILE)
    if (directory / PUBLISHED_CONFIG).exists():
        return _read_published(directory, vocab_size, target_layers)
    raise FileNotFoundError(f"{directory} is not an EAGLE head: it has neither {CONFIG_FILE} (a head from "
                            f"`specd train eagle`) nor {PUBLISHED_CONFIG} (a head as EAGLE's authors publish them)")


def _read_published(directory: Path, vocab_size: int,
                    target_layers: int) -> tuple[EagleConfig, dict[str, torch.Tensor]]:
    weights = _published_weights(directory)
    config = json.loads((directory / PUBLISHED_CONFIG).read_text())
    if config.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{directory}: an EAGLE head of {config['num_hidden_layers']} layers; one is supported")
    if config.get("vocab_size", vocab_size) != vocab_size:
        raise ValueError(f"{directory}: a head for a vocabulary of {config['vocab_size']} tokens; the target has "
                         f"{vocab_size}")
    if "midlayer.self_attn.q_proj.weight" in weights:
        return _eagle3(directory, config, weights, target_layers)
    _require(directory, weights, ("fc.weight", *(f"layers.0.{w}" for w in LAYER_WEIGHTS)), "an EAGLE-1/EAGLE-2")
    eagle = _config(config, vocab_size, input_norm=False, fc_bias="fc.bias" in weights)
    kept = {name: t for name, t in weights.items() if name.startswith(("fc.", "layers.0."))}
    return eagle, {**kept, "draft_vocab": torch.arange(vocab_size)}


def _eagle3(directory: Path, config: dict, weights: dict[str, torch.Tensor],
            target_layers: int) -> tuple[EagleConfig, dict[str, torch.Tensor]]:
    _require(directory, weights, (*EAGLE3_WEIGHTS, *(f"midlayer.{w}" for w in LAYER_WEIGHTS)), "an EAGLE-3")
    if config.get("target_hidden_size", config["hidden_size"]) != config["hidden_size"]:
        raise ValueError(f"{directory}: a head of hidden size {config['hidden_size']} for a target of "
                         f"{config['target_hidden_size']}; they must be the same")
    layers = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
        or (2, target_layers // 2, target_layers - 3)
    if any(not 0 <= layer < target_layers for layer in layers):
        raise ValueError(f"{directory}: the head drafts from target layers {list(layers)}; the target has "
                         f"{target_layers}")
    if weights["fc.weight"].shape[1] != config["hidden_size"] * len(layers):
        raise ValueError(f"{directory}: fc takes {weights['fc.weight'].shape[1]} values a token, not the "
                         f"{len(layers)} target layers' {config['hidden_size'] * len(layers)}")
    d2t = weights["d2t"].long()
    eagle = _config(config, d2t.shape[0], target_layers=tuple(int(layer) for layer in layers))
    kept = {name.replace("midlayer.", "layers.0.", 1): t for name, t in weights.items()
            if name.startswith("midlayer.")}
    return eagle, {**kept, "fc.weight": weights["fc.weight"], "norm.weight": weights["norm.weight"],
                   "lm_head.weight": weights["lm_head.weight"], "draft_vocab": torch.arange(d2t.shape[0]) + d2t}


def _config(config: dict, draft_vocab_size: int, **layout) -> EagleConfig:
    heads = config["num_attention_heads"]
    return EagleConfig(
        hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
        num_attention_heads=heads, num_key_value_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=float(_rope_theta(config)),
        max_position_embeddings=config.get("max_position_embeddings", 2048), draft_vocab_size=draft_vocab_size,
        target=config.get("_name_or_path", ""), rope_scaling=config.get("rope_scaling") or None, **layout)


def _rope_theta(config: dict) -> float:
    """Where transformers 4 writes it (`rope_theta`), or transformers 5 (`rope_parameters`)."""
    return config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta") or 10000.0


def _require(directory: Path, weights: dict[str, torch.Tensor], names: tuple[str, ...], kind: str) -> None:
    missing = [name for name in names if name not in weights]
    if missing:
        raise ValueError(f"{directory}: not {kind} head, it lacks {', '.join(missing)}")


def _published_weights(directory: Path) -> dict[str, torch.Tensor]:
    for name in PUBLISHED_WEIGHTS:
        path = directory / name
        if path.exists():
            return load_file(path) if path.suffix == ".safetensors" else torch.load(path, map_location="cpu",
                                                                                    weights_only=True)
    raise FileNotFoundError(f"{directory}: no head weights ({' or '.join(PUBLISHED_WEIGHTS)})")
