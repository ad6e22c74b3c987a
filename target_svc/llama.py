"""A Llama forward pass over a paged KV cache.

Numerics follow transformers' LlamaForCausalLM in fp32; the layout differs for
speed on CPU: q/k/v and gate/up are each one fused matmul, tokens of all
sequences are flattened into one [T, ...] batch (no padding), and the vocab
projection runs only on the rows whose logits are wanted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoConfig, PretrainedConfig

from target_svc.kv_cache import KVCache


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [D]
    qkv: torch.Tensor  # [(H + 2*KV) * Dh, D]
    o: torch.Tensor  # [D, H * Dh]
    post_norm: torch.Tensor  # [D]
    gate_up: torch.Tensor  # [2 * I, D]
    down: torch.Tensor  # [D, I]


@dataclass
class SeqSpan:
    """One sequence's share of a flattened batch."""
    start: int  # tokens already cached, at positions 0..start-1
    num_new: int  # new tokens, at positions start..start+num_new-1
    blocks: list[int]  # block table covering start + num_new tokens


class PagedAttention:
    """Per-forward plan: where new K/V are written and which cached keys each query reads.

    Each sequence attends on its own (no padding). A sequence whose blocks are
    one contiguous run reads its keys straight from the pool; otherwise its
    blocks are gathered, a whole block per index, into scratch buffers.
    """

    def __init__(self, spans: list[SeqSpan], write_slots: torch.Tensor, cache: KVCache, device="cpu"):
        self.cache = cache
        self.block_size = cache.block_size
        self.write_slots = write_slots.to(device)  # [T] cache slot of every new token, in batch order
        self.seqs = [_SeqPlan.build(span, self.block_size, device) for span in spans]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, KV, Dh] into the new tokens' slots."""
        self.cache.keys[layer].index_copy_(0, self.write_slots, k)
        self.cache.values[layer].index_copy_(0, self.write_slots, v)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [T, H, Dh] -> attention output [T, H * Dh]."""
        outs, first = [], 0
        for seq in self.seqs:
            k, v = self._keys_values(layer, seq)  # [L, KV, Dh] each
            qs = q[first:first + seq.num_new].transpose(0, 1).unsqueeze(0)  # [1, H, n, Dh]
            out = F.scaled_dot_product_attention(qs, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                                                 attn_mask=seq.mask, is_causal=seq.is_causal,
                                                 enable_gqa=True)  # [1, H, n, Dh]
            outs.append(out[0].transpose(0, 1).reshape(seq.num_new, -1))
            first += seq.num_new
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _keys_values(self, layer: int, seq: "_SeqPlan") -> tuple[torch.Tensor, torch.Tensor]:
        k_pool, v_pool = self.cache.keys[layer], self.cache.values[layer]
        if seq.first_slot is not None:
            return (k_pool[seq.first_slot:seq.first_slot + seq.context],
                    v_pool[seq.first_slot:seq.first_slot + seq.context])
        k_out, v_out = self.cache.gather_buffers(len(seq.blocks) * self.block_size)
        for pool, out in ((k_pool, k_out), (v_pool, v_out)):
            per_block = pool.view(-1, self.block_size * pool.shape[1] * pool.shape[2])  # [num_blocks, bs*KV*Dh]
            torch.index_select(per_block, 0, seq.blocks, out=out.view(len(seq.blocks), -1))
        return k_out[:seq.context], v_out[:seq.context]


@dataclass
class _SeqPlan:
    num_new: int
    context: int  # keys to attend over: start + num_new
    first_slot: int | None  # where the keys start in the pool when the blocks are one run
    blocks: torch.Tensor | None  # [num_blocks] block table to gather when they are not
    mask: torch.Tensor | None  # additive [n, L], built once and shared by all layers
    is_causal: bool  # a prefill from position 0: SDPA's own causal mask is exact

    @classmethod
    def build(cls, span: SeqSpan, block_size: int, device) -> "_SeqPlan":
        contiguous = all(b == span.blocks[0] + i for i, b in enumerate(span.blocks))
        context = span.start + span.num_new
        return cls(
            num_new=span.num_new,
            context=context,
            first_slot=span.blocks[0] * block_size if contiguous else None,
            blocks=None if contiguous else torch.tensor(span.blocks, dtype=torch.int64, device=device),
            mask=_offset_causal_mask(span.start, span.num_new, device),
            is_causal=span.start == 0 and span.num_new > 1,
        )


def _offset_causal_mask(start: int, num_new: int, device) -> torch.Tensor | None:
    """Additive mask [n, start + n]: query i (at position start + i) sees keys 0..start+i.

    None where no mask is needed: a single query sees everything, and a
    prefill from 0 uses SDPA's is_causal.
    """
    if num_new == 1 or start == 0:
        return None
    query_pos = start + torch.arange(num_new, device=device)  # [n]
    keys = torch.arange(start + num_new, device=device)  # [L]
    mask = torch.zeros(num_new, start + num_new, device=device)
    return mask.masked_fill_(keys[None, :] > query_pos[:, None], float("-inf"))


class Rope:
    """Precomputed rotary cos/sin tables, half width: [max_positions, Dh / 2]."""

    def __init__(self, config: PretrainedConfig, head_dim: int, device="cpu"):
        inv_freq, scale = _rope_inv_freq(config, head_dim)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]  # [P, Dh/2]
        self.cos = (freqs.cos() * scale).to(device)
        self.sin = (freqs.sin() * scale).to(device)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, Dh/2] for broadcasting over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, Dh]; same arithmetic as transformers' `x*cos + rotate_half(x)*sin`."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class LlamaModel:
    """Weights plus the forward pass; holds no per-sequence state (that lives in the KV cache)."""

    def __init__(self, config: PretrainedConfig, state: dict[str, torch.Tensor], device="cpu"):
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        state = {name.removeprefix("model."): t.to(device=device, dtype=torch.float32) for name, t in state.items()}
        self.embed = state["embed_tokens.weight"]  # [V, D]
        self.norm = state["norm.weight"]  # [D]
        self.lm_head = state.get("lm_head.weight", self.embed)  # [V, D]; tied when absent
        self.layers = [_layer_weights(state, f"layers.{i}.") for i in range(config.num_hidden_layers)]
        self.rope = Rope(config, self.head_dim, device)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, device="cpu") -> "LlamaModel":
        model_dir = Path(model_dir)
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(model_dir.glob("*.safetensors")):
            state.update(load_file(shard))
        return cls(AutoConfig.from_pretrained(model_dir), state, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: PagedAttention,
                logit_rows: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T]; logit_rows [R] -> logits [R, V]."""
        h = F.embedding(input_ids, self.embed)  # [T, D]
        cos, sin = self.rope.tables(positions)
        for i, layer in enumerate(self.layers):
            h = h + self._attention(i, layer, rms_norm(h, layer.input_norm, self.eps), cos, sin, attention)
            h = h + self._mlp(layer, rms_norm(h, layer.post_norm, self.eps))
        # The norm is per row, so gathering first keeps the vocab projection to the rows wanted.
        return F.linear(rms_norm(h[logit_rows], self.norm, self.eps), self.lm_head)

    def _attention(self, i: int, layer: LayerWeights, x, cos, sin, attention: PagedAttention):
        heads, kv = self.num_heads, self.num_kv_heads
        qkv = F.linear(x, layer.qkv).view(x.shape[0], heads + 2 * kv, self.head_dim)  # [T, H+2KV, Dh]
        qk = apply_rope(qkv[:, :heads + kv], cos, sin)  # [T, H+KV, Dh]
        attention.write(i, qk[:, heads:], qkv[:, heads + kv:])
        return F.linear(attention.attend(i, qk[:, :heads]), layer.o)

    def _mlp(self, layer: LayerWeights, x):
        gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)  # [T, I] each
        return F.linear(F.silu(gate) * up, layer.down)


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
