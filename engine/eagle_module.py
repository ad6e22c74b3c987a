"""The EAGLE head as a differentiable torch module, for training (`specd train eagle`): the same math as
`engine.eagle.EagleHead` over whole sequences with a causal mask instead of a paged KV cache. Its
`inference_state()` is what `EagleHead` loads."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.eagle import EagleConfig


class EagleHeadModule(nn.Module):
    def __init__(self, config: EagleConfig, target_embed: torch.Tensor, target_lm_head: torch.Tensor,
                 draft_vocab: torch.Tensor):
        super().__init__()
        d, heads, kv, dh = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.config = config
        self.fc = nn.Linear(2 * d, d, bias=config.fc_bias)
        self.input_norm = nn.Parameter(torch.ones(d)) if config.input_norm else None
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d, n * dh, bias=False) for n in (heads, kv, kv))
        self.o_proj = nn.Linear(heads * dh, d, bias=False)
        self.post_norm = nn.Parameter(torch.ones(d))
        self.gate_proj, self.up_proj = (nn.Linear(d, config.intermediate_size, bias=False) for _ in range(2))
        self.down_proj = nn.Linear(config.intermediate_size, d, bias=False)
        # The target's, frozen: buffers, so they move with .to() but are neither trained nor saved as the head's.
        self.register_buffer("embed", target_embed.float(), persistent=False)  # [V, D]
        self.register_buffer("lm_head", target_lm_head.float()[draft_vocab.long()], persistent=False)  # [V', D]
        self.register_buffer("draft_vocab", draft_vocab.long(), persistent=False)
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, dh, 2).float() / dh)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        for linear in (self.fc, self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.gate_proj, self.up_proj,
                       self.down_proj):
            nn.init.normal_(linear.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Pairs (x_{p+1}, f_p) at positions 0..T-1: input_ids [B, T], features [B, T, D] -> g [B, T, D], each
        seeing the pairs before it."""
        c = self.config
        b, t, _ = features.shape
        h = self.fc(torch.cat([F.embedding(input_ids, self.embed), features], dim=-1))  # [B, T, D]
        x = h if self.input_norm is None else _rms_norm(h, self.input_norm, c.rms_norm_eps)
        q, k, v = (proj(x).view(b, t, -1, c.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))  # [B, H or KV, T, Dh]
        cos, sin = self._rope(t, x.device)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # [B, H, T, Dh]
        h = h + self.o_proj(attended.transpose(1, 2).reshape(b, t, -1))
        x = _rms_norm(h, self.post_norm, c.rms_norm_eps)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary [..., V'] of features g [..., D]."""
        return g @ self.lm_head.T

    def inference_state(self) -> dict[str, torch.Tensor]:
        """The weights under the names `EagleHead` loads (a Llama checkpoint's, for the layer)."""
        return {name: t.detach().cpu().contiguous().clone() for name, t in self._by_inference_name().items()}

    def load_inference_state(self, state: dict[str, torch.Tensor]) -> None:
        """The weights of `inference_state()` back; the module must have been built with the same draft vocabulary."""
        if not torch.equal(state["draft_vocab"].long(), self.draft_vocab.cpu()):
            raise ValueError("the state's draft vocabulary is not this module's")
        with torch.no_grad():
            for name, tensor in self._by_inference_name().items():
                tensor.copy_(state[name])

    def _by_inference_name(self) -> dict[str, torch.Tensor]:
        layer = {"post_attention_layernorm.weight": self.post_norm,
                 **{f"self_attn.{n}.weight": getattr(self, n).weight for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
                 **{f"mlp.{n}.weight": getattr(self, n).weight for n in ("gate_proj", "up_proj", "down_proj")}}
        if self.input_norm is not None:
            layer["input_layernorm.weight"] = self.input_norm
        fc = {"fc.weight": self.fc.weight, **({"fc.bias": self.fc.bias} if self.fc.bias is not None else {})}
        return {**{f"layers.0.{name}": w for name, w in layer.items()}, **fc, "draft_vocab": self.draft_vocab}

    def _rope(self, t: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.arange(t, device=device).float()[:, None] * self.inv_freq[None, :]  # [T, Dh/2]
        return freqs.cos(), freqs.sin()


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's rotary embedding (halves rotated) of x [B, H, T, Dh] by the half tables [T, Dh/2]."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
