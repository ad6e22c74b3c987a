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

    K/V are gathered a whole block at a time (one index per block, not per
    token). When every sequence has the same number of new tokens, all of them
    run as one padded SDPA call; otherwise each sequence runs on its own.
    """

    def __init__(self, spans: list[SeqSpan], block_size: int, device="cpu"):
        self.block_size = block_size
        self.write_slots = _slots(spans, block_size).to(device)  # [T]
        self.batched = len({s.num_new for s in spans}) == 1
        self.num_new = [s.num_new for s in spans]
        self.context = max(s.start + s.num_new for s in spans)
        if self.batched:
            self._plan_batched(spans, device)
        else:
            self._plan_per_sequence(spans, device)

    def _plan_batched(self, spans: list[SeqSpan], device) -> None:
        width = max(len(s.blocks) for s in spans)
        # Pad block tables with block 0: those keys lie past every query's position, so are masked.
        table = [s.blocks + [0] * (width - len(s.blocks)) for s in spans]
        self.blocks = torch.tensor(table, dtype=torch.int64, device=device).flatten()  # [B * width]
        self.width = width
        starts = torch.tensor([s.start for s in spans], device=device)
        self.mask = _visible(starts, spans[0].num_new, self.context, device)  # [B, 1, n, L] or None

    def _plan_per_sequence(self, spans: list[SeqSpan], device) -> None:
        self.seq_blocks = [torch.tensor(s.blocks, dtype=torch.int64, device=device) for s in spans]
        self.seq_context = [s.start + s.num_new for s in spans]
        self.seq_masks = [_visible(torch.tensor([s.start], device=device), s.num_new, s.start + s.num_new, device)
                          for s in spans]

    def write(self, k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        k_pool.index_copy_(0, self.write_slots, k)
        v_pool.index_copy_(0, self.write_slots, v)

    def attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        """q [T, H, Dh] -> attention output [T, H * Dh]."""
        if self.batched:
            return self._attend_batched(q, k_pool, v_pool)
        return self._attend_per_sequence(q, k_pool, v_pool)

    def _attend_batched(self, q, k_pool, v_pool) -> torch.Tensor:
        batch, n = len(self.num_new), self.num_new[0]
        k = self._gather(k_pool, self.blocks).view(batch, -1, *k_pool.shape[1:])[:, :self.context]  # [B, L, KV, Dh]
        v = self._gather(v_pool, self.blocks).view(batch, -1, *v_pool.shape[1:])[:, :self.context]
        qb = q.view(batch, n, *q.shape[1:]).transpose(1, 2)  # [B, H, n, Dh]
        out = F.scaled_dot_product_attention(qb, k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=self.mask, enable_gqa=True)  # [B, H, n, Dh]
        return out.transpose(1, 2).reshape(batch * n, -1)

    def _attend_per_sequence(self, q, k_pool, v_pool) -> torch.Tensor:
        outs, first = [], 0
        for n, blocks, length, mask in zip(self.num_new, self.seq_blocks, self.seq_context, self.seq_masks):
            k = self._gather(k_pool, blocks)[:length].transpose(0, 1)  # [KV, L, Dh]
            v = self._gather(v_pool, blocks)[:length].transpose(0, 1)
            qs = q[first:first + n].transpose(0, 1)  # [H, n, Dh]
            out = F.scaled_dot_product_attention(qs.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                                 attn_mask=mask, enable_gqa=True)  # [1, H, n, Dh]
            outs.append(out[0].transpose(0, 1).reshape(n, -1))
            first += n
        return torch.cat(outs)

    def _gather(self, pool: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """[num_slots, KV, Dh] pool -> [len(blocks) * block_size, KV, Dh] in block-table order."""
        per_block = pool.view(-1, self.block_size * pool.shape[1] * pool.shape[2])
        return per_block.index_select(0, blocks).view(-1, *pool.shape[1:])


def _slots(spans: list[SeqSpan], block_size: int) -> torch.Tensor:
    """Cache slot of every new token, flattened in batch order."""
    slots = []
    for s in spans:
        table = torch.tensor(s.blocks, dtype=torch.int64)
        positions = torch.arange(s.start, s.start + s.num_new)
        slots.append(table[positions // block_size] * block_size + positions % block_size)
    return torch.cat(slots)


def _visible(starts: torch.Tensor, num_new: int, context: int, device) -> torch.Tensor | None:
    """Boolean mask [B, 1, n, L]: query i of a sequence starting at `start` sees keys 0..start+i.

    None when nothing is masked (one new token per sequence, all at the last position).
    """
    if num_new == 1 and bool((starts == context - 1).all()):
        return None
    query_pos = starts[:, None] + torch.arange(num_new, device=device)[None, :]  # [B, n]
    keys = torch.arange(context, device=device)  # [L]
    return (keys[None, None, :] <= query_pos[:, :, None]).unsqueeze(1)


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
                cache: KVCache, logit_rows: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T]; logit_rows [R] -> logits [R, V]."""
        h = F.embedding(input_ids, self.embed)  # [T, D]
        cos, sin = self.rope.tables(positions)
        for layer, k_pool, v_pool in zip(self.layers, cache.keys, cache.values):
            h = h + self._attention(layer, rms_norm(h, layer.input_norm, self.eps), cos, sin,
                                    attention, k_pool, v_pool)
            h = h + self._mlp(layer, rms_norm(h, layer.post_norm, self.eps))
        # The norm is per row, so gathering first keeps the vocab projection to the rows wanted.
        return F.linear(rms_norm(h[logit_rows], self.norm, self.eps), self.lm_head)

    def _attention(self, layer: LayerWeights, x, cos, sin, attention: PagedAttention, k_pool, v_pool):
        heads, kv = self.num_heads, self.num_kv_heads
        qkv = F.linear(x, layer.qkv).view(x.shape[0], heads + 2 * kv, self.head_dim)  # [T, H+2KV, Dh]
        qk = apply_rope(qkv[:, :heads + kv], cos, sin)  # [T, H+KV, Dh]
        attention.write(k_pool, v_pool, qk[:, heads:], qkv[:, heads + kv:])
        return F.linear(attention.attend(qk[:, :heads], k_pool, v_pool), layer.o)

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
