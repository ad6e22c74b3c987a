"""A Llama forward pass over a paged KV cache.

Numerics follow transformers' LlamaForCausalLM in fp32; the layout differs for
speed on CPU: q/k/v and gate/up are each one fused matmul, each matmul uses
the GEMM formulation measured fastest for its row count, tokens of all
sequences are flattened into one [T, ...] batch (no padding), and the vocab
projection runs only on the rows whose logits are wanted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate
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


# Sequences with at most this many new tokens share one padded attention call:
# for them attention is bound by reading the cached K/V, so padding queries is
# nearly free, while one call per sequence costs ~1.5x more (measured on CPU,
# 8 sequences with 1000 cached tokens each).
SMALL_QUERY = 64


class PagedAttention:
    """Per-forward plan: where new K/V are written and which cached keys each query reads.

    Sequences attend in groups, one SDPA call per group: all sequences with at
    most SMALL_QUERY new tokens together (queries padded to the longest, block
    tables to the widest), every longer one on its own. A group's blocks are
    gathered, a whole block per index, into scratch buffers reused by every layer.
    """

    def __init__(self, spans: list[SeqSpan], write_slots: torch.Tensor, cache: KVCache, device="cpu"):
        self.cache = cache
        self.block_size = cache.block_size
        self.write_slots = write_slots.to(device)  # [T] cache slot of every new token, in batch order
        self.num_tokens = sum(s.num_new for s in spans)
        firsts = list(accumulate((s.num_new for s in spans[:-1]), initial=0))  # each span's first row
        small = [i for i, s in enumerate(spans) if s.num_new <= SMALL_QUERY]
        members = [small] if small else []
        members += [[i] for i, s in enumerate(spans) if s.num_new > SMALL_QUERY]
        self.groups = [_Group.build([spans[i] for i in m], [firsts[i] for i in m], self.block_size, device)
                       for m in members]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, KV, Dh] into the new tokens' slots."""
        self.cache.keys[layer].index_copy_(0, self.write_slots, k)
        self.cache.values[layer].index_copy_(0, self.write_slots, v)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [T, H, Dh] -> attention output [T, H * Dh]."""
        if len(self.groups) == 1 and isinstance(self.groups[0].rows, slice):  # every token, in order
            return self._attend_group(layer, self.groups[0], q)
        out = q.new_empty(self.num_tokens, q.shape[1] * q.shape[2])
        for group in self.groups:
            out[group.dest] = self._attend_group(layer, group, q[group.rows])[group.real]
        return out

    def _attend_group(self, layer: int, group: "_Group", q: torch.Tensor) -> torch.Tensor:
        """q [G * n, H, Dh] -> [G * n, H * Dh]."""
        k, v = self._gather(layer, group.blocks)  # [G * width * bs, KV, Dh] each
        k = k.view(group.num_seqs, -1, *k.shape[1:])[:, :group.context].transpose(1, 2)  # [G, KV, L, Dh]
        v = v.view(group.num_seqs, -1, *v.shape[1:])[:, :group.context].transpose(1, 2)
        qg = q.view(group.num_seqs, group.num_queries, *q.shape[1:]).transpose(1, 2)  # [G, H, n, Dh]
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=group.mask, is_causal=group.is_causal,
                                             enable_gqa=True)  # [G, H, n, Dh]
        return out.transpose(1, 2).reshape(group.num_seqs * group.num_queries, -1)

    def _gather(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's cached K and V for `blocks`, in order: [len(blocks) * bs, KV, Dh] each."""
        k_out, v_out = self.cache.gather_buffers(len(blocks) * self.block_size)
        for pool, out in ((self.cache.keys[layer], k_out), (self.cache.values[layer], v_out)):
            per_block = pool.view(-1, self.block_size * pool.shape[1] * pool.shape[2])  # [num_blocks, bs*KV*Dh]
            torch.index_select(per_block, 0, blocks, out=out.view(len(blocks), -1))
        return k_out, v_out


@dataclass
class _Group:
    """G sequences attended in one call, each padded to n queries and L keys.

    Row selectors are slices where the rows are consecutive, so the common
    cases (every sequence alike, or a single one) move no data.
    """
    num_seqs: int  # G
    num_queries: int  # n: the most new tokens of any member
    context: int  # L: the longest member's start + num_new
    rows: slice | torch.Tensor  # [G * n] batch rows of the queries; a pad repeats its sequence's last row
    real: slice | torch.Tensor  # which of the G * n outputs are real
    dest: slice | torch.Tensor  # the batch rows those real outputs belong to
    blocks: torch.Tensor  # [G * width] block tables, padded with block 0
    mask: torch.Tensor | None  # additive [G, 1, n, L], built once and shared by every layer
    is_causal: bool  # prefills from position 0 of equal length: SDPA's own causal mask is exact

    @classmethod
    def build(cls, spans: list[SeqSpan], firsts: list[int], block_size: int, device) -> "_Group":
        n = max(s.num_new for s in spans)
        width = max(len(s.blocks) for s in spans)
        uniform = all(s.num_new == n for s in spans)
        is_causal = n > 1 and uniform and all(s.start == 0 for s in spans)
        if uniform and firsts == list(range(firsts[0], firsts[0] + n * len(spans), n)):
            rows = dest = slice(firsts[0], firsts[0] + n * len(spans))
            real = slice(None)
        else:
            rows = _int64([f + min(i, s.num_new - 1) for s, f in zip(spans, firsts) for i in range(n)], device)
            real = _int64([b * n + i for b, s in enumerate(spans) for i in range(s.num_new)], device)
            dest = _int64([f + i for s, f in zip(spans, firsts) for i in range(s.num_new)], device)
        # Pad tables with block 0: keys past a sequence's own queries' positions are masked.
        table = [b for s in spans for b in s.blocks + [0] * (width - len(s.blocks))]
        return cls(
            num_seqs=len(spans), num_queries=n, context=max(s.start + s.num_new for s in spans),
            rows=rows, real=real, dest=dest, blocks=_int64(table, device),
            mask=None if is_causal else _visible_keys(spans, n, device), is_causal=is_causal,
        )


def _visible_keys(spans: list[SeqSpan], n: int, device) -> torch.Tensor | None:
    """Additive mask [G, 1, n, L]: query i of a sequence starting at `start` sees keys 0..start+i.

    None when nothing is masked: one query per sequence, all with the same context.
    """
    context = max(s.start + s.num_new for s in spans)
    starts = _int64([s.start for s in spans], device)
    if n == 1 and bool((starts == context - 1).all()):
        return None
    query_pos = starts[:, None] + torch.arange(n, device=device)[None, :]  # [G, n]
    hidden = torch.arange(context, device=device)[None, None, :] > query_pos[:, :, None]  # [G, n, L]
    return torch.zeros(hidden.shape, device=device).masked_fill_(hidden, float("-inf")).unsqueeze(1)


def _int64(values: list[int], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


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


# Which fp32 GEMM formulation is fastest depends on the row count M (the new
# tokens) and the thread count, by up to 4x. Measured with torch 2.13 (MKL +
# oneDNN) on a 2-core AMD EPYC over weights shaped like the default model's
# (30 layers + vocab projection), in ms per forward:
#
#   M                        1    2    4    8   16   32  256
#   2 threads  F.linear     52   94   71   67   80  113  534
#              transposed   23   24   34   54   77  109  598
#              oneDNN       32   47   50   57   73   97  477
#   1 thread   F.linear     53   94   72   84  113  167  968
#              transposed   38   37   58   98  136  200 1103
#              oneDNN       47   83   89  100  129  183  960
#
# "transposed" is MKL's GEMM with the few rows as its small n side, i.e.
# (weight @ x^T)^T, rows padded to 2, 4 or 8 (n = 1 drops to a slow GEMV).


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K], weight [N, K] -> x @ weight^T [M, N], by the formulation measured fastest for M."""
    if x.device.type != "cpu":
        return F.linear(x, weight)
    rows, single_thread = x.shape[0], torch.get_num_threads() == 1
    if rows <= (4 if single_thread else 8):
        return transposed_linear(x, weight)
    if ONEDNN and (rows > 128 or not single_thread):
        return onednn_linear(x, weight)
    return F.linear(x, weight)


def transposed_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T computed as (weight @ x^T)^T, rows padded to a power of two of at least 2."""
    rows = x.shape[0]
    padded = max(2, 1 << max(rows - 1, 0).bit_length())
    x_pad = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])]) if padded > rows else x  # [p, K]
    return torch.mm(weight, x_pad.t()).t()[:rows].contiguous()


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T by oneDNN: a private op (the one torch.compile's CPU backend emits)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def _onednn_linear_works() -> bool:
    try:
        onednn_linear(torch.ones(9, 2), torch.ones(3, 2))
    except (AttributeError, RuntimeError):
        return False
    return True


ONEDNN = _onednn_linear_works()


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
        return linear(rms_norm(h[logit_rows], self.norm, self.eps), self.lm_head)

    def _attention(self, i: int, layer: LayerWeights, x, cos, sin, attention: PagedAttention):
        heads, kv = self.num_heads, self.num_kv_heads
        qkv = linear(x, layer.qkv).view(x.shape[0], heads + 2 * kv, self.head_dim)  # [T, H+2KV, Dh]
        qk = apply_rope(qkv[:, :heads + kv], cos, sin)  # [T, H+KV, Dh]
        attention.write(i, qk[:, heads:], qkv[:, heads + kv:])
        return linear(attention.attend(i, qk[:, :heads]), layer.o)

    def _mlp(self, layer: LayerWeights, x):
        gate, up = linear(x, layer.gate_up).chunk(2, dim=-1)  # [T, I] each
        return linear(F.silu(gate) * up, layer.down)


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
