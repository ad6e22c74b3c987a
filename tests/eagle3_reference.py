"""EAGLE-3 as its authors define it, in plain torch over whole sequences (a causal mask, no KV cache), and a
random head for a model written in their published layout: what specd's paged EAGLE-3 head is checked
against. Written from EAGLE-3's model code: `fc` takes three target layers' inputs [3D] to one hidden state;
the layer's attention reads [input_layernorm(embedding) ; hidden_norm(hidden)], its output and MLP add to
the hidden state; the head's own final norm and LM head give logits over the draft vocabulary, `d2t` maps a
draft token to its target token (draft + d2t[draft])."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoConfig

from engine.eagle import target_embedding_and_lm_head

DRAFT_VOCAB = 500


class Eagle3Reference:
    def __init__(self, weights: dict[str, torch.Tensor], embed: torch.Tensor, config: dict):
        self.w = {name: t.float() if t.is_floating_point() else t for name, t in weights.items()}
        self.embed = embed.float()
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim, self.eps = config["head_dim"], config["rms_norm_eps"]
        dh = self.head_dim
        self.inv_freq = 1.0 / config["rope_theta"] ** (torch.arange(0, dh, 2).float() / dh)
        self.draft_vocab = torch.arange(weights["d2t"].shape[0]) + weights["d2t"]

    def hidden(self, features: torch.Tensor) -> torch.Tensor:
        """A row's hidden state: fc of the target's three layers [3D], or the head's own g [D] as it is."""
        features = features.float()
        return features @ self.w["fc.weight"].T if features.shape[-1] != self.embed.shape[1] else features

    def __call__(self, input_ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """Pairs (x_{p+1}, h_p) at positions 0..T-1, hidden [T, D] -> g [T, D], each seeing the pairs before it."""
        w, t = self.w, len(input_ids)
        m = lambda name: w[f"midlayer.{name}"]  # noqa: E731
        x = torch.cat([_rms(F.embedding(torch.tensor(input_ids), self.embed), m("input_layernorm.weight"), self.eps),
                       _rms(hidden, m("hidden_norm.weight"), self.eps)], dim=-1)  # [T, 2D]
        q, k, v = ((x @ m(f"self_attn.{p}_proj.weight").T).view(t, n, self.head_dim).transpose(0, 1)
                   for p, n in (("q", self.heads), ("k", self.kv_heads), ("v", self.kv_heads)))
        freqs = torch.arange(t).float()[:, None] * self.inv_freq[None, :]
        q, k = _rotate(q, freqs.cos(), freqs.sin()), _rotate(k, freqs.cos(), freqs.sin())
        attended = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=True)[0]
        h = hidden + attended.transpose(0, 1).reshape(t, -1) @ m("self_attn.o_proj.weight").T
        y = _rms(h, m("post_attention_layernorm.weight"), self.eps)
        gated = F.silu(y @ m("mlp.gate_proj.weight").T) * (y @ m("mlp.up_proj.weight").T)
        return h + gated @ m("mlp.down_proj.weight").T

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """[.., V'] over the draft vocabulary."""
        return _rms(g, self.w["norm.weight"], self.eps) @ self.w["lm_head.weight"].T


def write_published_eagle3_head(model_dir: Path, path: Path, layers: list[int] | None = None, seed: int = 0,
                                sureness: float = 1.0) -> Eagle3Reference:
    """A random EAGLE-3 head for the model in `model_dir` in the published layout (config.json with
    `draft_vocab_size`, and `eagle_config.eagle_aux_hidden_state_layer_ids` where `layers` are given;
    model.safetensors with `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`); its reference. `sureness`
    scales its logits: a random head is otherwise never sure enough of a token for the target to verify it."""
    target = AutoConfig.from_pretrained(model_dir)
    d, inter, dh = target.hidden_size, target.intermediate_size, target.head_dim
    heads, kv = target.num_attention_heads, target.num_key_value_heads
    g = torch.Generator().manual_seed(seed)
    normal = lambda *shape: torch.randn(*shape, generator=g) * 0.1  # noqa: E731
    norm = lambda: 0.5 + torch.rand(d, generator=g)  # noqa: E731  (away from one, so a mixed-up norm shows)
    draft_to_target = torch.randperm(target.vocab_size, generator=g)[:DRAFT_VOCAB].sort().values
    weights = {
        "fc.weight": normal(d, 3 * d), "norm.weight": norm(), "lm_head.weight": sureness * normal(DRAFT_VOCAB, d),
        "d2t": draft_to_target - torch.arange(DRAFT_VOCAB),
        "t2d": torch.zeros(target.vocab_size, dtype=torch.bool).index_fill_(0, draft_to_target, True),
        "midlayer.input_layernorm.weight": norm(), "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": normal(heads * dh, 2 * d),
        "midlayer.self_attn.k_proj.weight": normal(kv * dh, 2 * d),
        "midlayer.self_attn.v_proj.weight": normal(kv * dh, 2 * d),
        "midlayer.self_attn.o_proj.weight": normal(d, heads * dh),
        "midlayer.mlp.gate_proj.weight": normal(inter, d), "midlayer.mlp.up_proj.weight": normal(inter, d),
        "midlayer.mlp.down_proj.weight": normal(d, inter),
    }
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": d,
              "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": dh,
              "num_hidden_layers": 1, "rms_norm_eps": target.rms_norm_eps, "rope_theta": 100000.0,
              "max_position_embeddings": target.max_position_embeddings, "vocab_size": target.vocab_size,
              "draft_vocab_size": DRAFT_VOCAB, "hidden_act": "silu", "tie_word_embeddings": False}
    if layers is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layers}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights, path / "model.safetensors")
    return Eagle3Reference(weights, target_embedding_and_lm_head(model_dir)[0], config)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's rotary embedding (halves rotated) of x [H, T, Dh] by the half tables [T, Dh/2]."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
