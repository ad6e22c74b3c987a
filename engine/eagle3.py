"""An EAGLE-3 head (Li et al., EAGLE-3: scaling up inference acceleration of large language models via
training-time test), as its authors publish them.

It drafts from three of the target's layers, not its last: the residual stream entering each of them,
concatenated [3D], which `fc` takes to one hidden state h_p. Its one decoder layer reads the normed
embedding of x_{p+1} beside the normed h_p ([2D] into its attention) and adds its output to h_p; the
result g_p goes through the head's own final norm and LM head over its draft vocabulary (`d2t`: the
target token of each draft token), and is fed back as the hidden state of the next drafted pair, which
`fc` then leaves as it is (it is D wide already).
"""
from __future__ import annotations

import torch

import kernels
from engine.attention import PagedAttention
from engine.config import EngineConfig
from engine.eagle_config import EagleConfig
from engine.llama import LlamaModel


class Eagle3Head(LlamaModel):
    """The head for inference on a paged KV cache: a one-layer LlamaModel whose layer takes [2D]."""

    def __init__(self, config: EagleConfig, head_state: dict[str, torch.Tensor], target_embed: torch.Tensor,
                 engine: EngineConfig = EngineConfig()):
        state = {name: t for name, t in head_state.items()
                 if name.startswith("layers.0.") and name != "layers.0.hidden_norm.weight"}
        state.update({"embed_tokens.weight": target_embed, "norm.weight": head_state["norm.weight"],
                      "lm_head.weight": head_state["lm_head.weight"]})
        super().__init__(config.layer_config(target_embed.shape[0]), state, engine)
        self.eagle_config = config
        self.hidden_norm = head_state["layers.0.hidden_norm.weight"].to(device=engine.device, dtype=engine.dtype)
        self.fc = self.linear.prepare(head_state["fc.weight"].to(device=engine.device, dtype=engine.dtype))  # [D, 3D]
        self.draft_vocab = head_state["draft_vocab"].long().to(engine.device)  # [V'] target token ids

    def draft(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
              attention: PagedAttention, logit_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pairs (x_{p+1}, h_p): input_ids [T], features [T, 3D] (the target's) or [T, D] (the head's own g),
        positions [T] (p) -> fp32 logits over the draft vocabulary [R, V'] of the rows `logit_rows`, and g [T, D]."""
        if features.shape[1] != self.eagle_config.hidden_size:
            h = self.linear.by_rows(features.to(self.embed.dtype), self.fc, attention.matmul_rows)
        else:  # a copy: the residual stream below is updated in place
            h = features.to(self.embed.dtype, copy=True)
        layer, eps = self.layers[0], self.eps
        x = torch.cat([kernels.add_rms_norm(self.embedding(input_ids), None, layer.input_norm, eps),
                       kernels.add_rms_norm(h, None, self.hidden_norm, eps)], dim=-1)  # [T, 2D]
        cos, sin = self.rope.tables(positions)
        x = kernels.add_rms_norm(h, self._attention(0, layer, x, cos, sin, attention), layer.post_norm, eps)
        h.add_(self._mlp(layer, x, attention.matmul_rows))
        return self.logits(h, logit_rows), h
