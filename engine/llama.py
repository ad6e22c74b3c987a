"""The Llama model math: weights, loading, and one forward pass over a flattened batch.

Numerics follow transformers' LlamaForCausalLM in the engine's dtype (RMSNorm
statistics in fp32, as transformers computes them): op for op in fp32; in 16-bit
dtypes on CPU the row-wise ops (residual add + RMSNorm, RoPE, SiLU * up) are fused
kernels that round where transformers does. The layout differs for speed on
CPU: q/k/v and gate/up are each one fused matmul, tokens of all
sequences are flattened into one [T, ...] batch (no padding), and the vocab
projection runs only on the rows whose logits are wanted. Where the K/V go and
which keys each query sees is the `PagedAttention` plan's business.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoConfig, PretrainedConfig

import kernels
from engine.attention import PagedAttention
from engine.config import EngineConfig
from engine.linear_cpu import LinearPlan, shared_runs


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [D]
    qkv: torch.Tensor  # [(H + 2*KV) * Dh, D]
    o: torch.Tensor  # [D, H * Dh]
    post_norm: torch.Tensor  # [D]
    gate_up: torch.Tensor  # [2 * I, D]
    down: torch.Tensor  # [D, I]

    def matmuls(self) -> list[torch.Tensor]:
        return [self.qkv, self.o, self.gate_up, self.down]

    def prepared(self, prepare: Callable[[torch.Tensor], torch.Tensor]) -> LayerWeights:
        """The matmul weights as the engine's matmul wants them (e.g. packed for oneDNN)."""
        return replace(self, qkv=prepare(self.qkv), o=prepare(self.o), gate_up=prepare(self.gate_up),
                       down=prepare(self.down))


class Rope:
    """Precomputed rotary cos/sin tables, half width: [max_positions, Dh / 2], computed in fp32."""

    def __init__(self, config: PretrainedConfig, head_dim: int, engine: EngineConfig):
        inv_freq, scale = _rope_inv_freq(config, head_dim)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]  # [P, Dh/2]
        self.cos = (freqs.cos() * scale).to(device=engine.device, dtype=engine.dtype)
        self.sin = (freqs.sin() * scale).to(device=engine.device, dtype=engine.dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, Dh/2]."""
        return self.cos[positions], self.sin[positions]


def _rope_parameters(config: PretrainedConfig) -> dict:
    """transformers 5 keeps these in `rope_parameters`; 4.x in `rope_theta` + `rope_scaling`."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _rope_inv_freq(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    params = _rope_parameters(config)
    inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if params["rope_type"] == "default":
        return inv_freq, 1.0
    if params["rope_type"] == "llama3":
        return _llama3_inv_freq(inv_freq, params), 1.0
    raise NotImplementedError(f"rope_type {params['rope_type']!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, a smooth ramp between."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
    return torch.where(is_medium, smoothed, scaled)


class LayerInputs:
    """Rows of the residual stream entering some of the layers, kept as a forward passes them (EAGLE-3
    drafts from three of the target's layers)."""

    def __init__(self, layers: tuple[int, ...], rows: torch.Tensor):
        self.layers, self.rows = layers, rows
        self._kept: dict[int, torch.Tensor] = {}

    def see(self, layer: int, h: torch.Tensor) -> None:
        """h [T, D] is the residual stream entering `layer`."""
        if layer in self.layers:
            self._kept[layer] = h[self.rows]  # a copy: h goes on changing in place

    def concatenated(self) -> torch.Tensor:
        """[len(rows), len(layers) * D], the layers in the order asked."""
        return torch.cat([self._kept[layer] for layer in self.layers], dim=-1)


class LlamaModel:
    """Weights plus the forward pass; holds no per-sequence state (that lives in the KV cache)."""

    def __init__(self, config: PretrainedConfig, state: dict[str, torch.Tensor],
                 engine: EngineConfig = EngineConfig()):
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        state = {name.removeprefix("model."): t.to(device=engine.device, dtype=engine.dtype)
                 for name, t in state.items()}
        self.embed = state["embed_tokens.weight"]  # [V, D]
        self.norm = state["norm.weight"]  # [D]
        layers = [_layer_weights(state, f"layers.{i}.") for i in range(config.num_hidden_layers)]
        lm_head = state.get("lm_head.weight", self.embed)  # [V, D]; tied when absent
        self.linear = LinearPlan.measure(layers[0].matmuls() + [lm_head])
        self.layers = [layer.prepared(self.linear.prepare) for layer in layers]
        self.lm_head = self.linear.prepare(lm_head)
        self.matmul_rows_independent = self.linear.rows_independent(self.layers[0].matmuls() + [self.lm_head])
        self.rope = Rope(config, self.head_dim, engine)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, engine: EngineConfig = EngineConfig(),
                        num_layers: int | None = None) -> LlamaModel:
        """The model in `model_dir`; with num_layers, only its first layers, then its final norm and LM
        head (a LayerSkip-style early exit: the self-speculative draft model)."""
        model_dir = Path(model_dir)
        config = AutoConfig.from_pretrained(model_dir)
        if num_layers is not None:
            if not 1 <= num_layers <= config.num_hidden_layers:
                raise ValueError(f"num_layers must be in 1..{config.num_hidden_layers}, got {num_layers}")
            config.num_hidden_layers = num_layers
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(model_dir.glob("*.safetensors")):
            state.update(load_file(shard))
        return cls(config, state, engine)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: PagedAttention,
                logit_rows: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] (RoPE positions); logit_rows [R] -> fp32 logits [R, V]."""
        return self.logits(self.final_hidden(self.embedding(input_ids), positions, attention), logit_rows)

    def embedding(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, D]"""
        return F.embedding(input_ids, self.embed)

    def final_hidden(self, h: torch.Tensor, positions: torch.Tensor, attention: PagedAttention,
                     layer_inputs: LayerInputs | None = None) -> torch.Tensor:
        """The residual stream [T, D] from the input embeddings `h` through every layer (h is updated in place),
        before the final norm; `layer_inputs` keeps its rows of the stream entering the layers it names."""
        cos, sin = self.rope.tables(positions)
        x = self._first_layer_input(h)
        for i, layer in enumerate(self.layers):
            if layer_inputs is not None:
                layer_inputs.see(i, h)
            x = kernels.add_rms_norm(h, self._attention(i, layer, x, cos, sin, attention), layer.post_norm, self.eps)
            mlp = self._mlp(layer, x, attention.matmul_rows)
            if i + 1 < len(self.layers):
                x = kernels.add_rms_norm(h, mlp, self.layers[i + 1].input_norm, self.eps)
            else:
                h.add_(mlp)
        return h

    def _first_layer_input(self, h: torch.Tensor) -> torch.Tensor:
        """What the first layer's attention reads of the residual stream h: its input norm of it."""
        return kernels.add_rms_norm(h, None, self.layers[0].input_norm, self.eps)

    def normed(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm of residual rows h [R, D]: the features the LM head reads (and EAGLE's input)."""
        return kernels.add_rms_norm(h, None, self.norm, self.eps)

    def logits(self, h: torch.Tensor, logit_rows: torch.Tensor) -> torch.Tensor:
        """fp32 logits [R, V] of the residual rows `logit_rows` of h [T, D]."""
        # The norm is per row, so gathering first keeps the vocab projection to the rows wanted.
        last = self.normed(h[logit_rows])
        return self.linear.by_rows(last, self.lm_head, shared_runs(0, last.shape[0])).float()  # the verifier needs fp32

    def _attention(self, i: int, layer: LayerWeights, x, cos, sin, attention: PagedAttention):
        heads, kv = self.num_heads, self.num_kv_heads
        rows = attention.matmul_rows
        qkv = self.linear.by_rows(x, layer.qkv, rows).view(x.shape[0], heads + 2 * kv, self.head_dim)  # [T, H+2KV, Dh]
        qk = kernels.rotate(qkv[:, :heads + kv], cos, sin)  # [T, H+KV, Dh]
        attention.write(i, qk[:, heads:], qkv[:, heads + kv:])
        return self.linear.by_rows(attention.attend(i, qk[:, :heads]), layer.o, rows)

    def _mlp(self, layer: LayerWeights, x, rows: list[slice]):
        return self.linear.by_rows(kernels.silu_mul(self.linear.by_rows(x, layer.gate_up, rows)), layer.down, rows)


def _layer_weights(state: dict[str, torch.Tensor], prefix: str) -> LayerWeights:
    def w(name: str) -> torch.Tensor:
        return state[prefix + name]

    if any(prefix + f"self_attn.{p}.bias" in state for p in ("q_proj", "k_proj", "v_proj", "o_proj")) or \
            prefix + "mlp.gate_proj.bias" in state:
        raise NotImplementedError("Llama checkpoints with attention or MLP biases")
    return LayerWeights(
        input_norm=w("input_layernorm.weight"),
        qkv=torch.cat([w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"), w("self_attn.v_proj.weight")]),
        o=w("self_attn.o_proj.weight"),
        post_norm=w("post_attention_layernorm.weight"),
        gate_up=torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]),
        down=w("mlp.down_proj.weight"),
    )
