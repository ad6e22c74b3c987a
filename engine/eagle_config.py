"""An EAGLE head's shape, as `specd train eagle` saves it beside the weights (`eagle_config.json`)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from transformers import LlamaConfig

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
    # EAGLE's published heads: their layer takes fc's output as it is (no input norm), and their fc may
    # have a bias. `specd train eagle` heads normalize the layer's input and have none.
    input_norm: bool = True
    fc_bias: bool = False
    # EAGLE-3: the target layers whose input (the residual stream entering them) the head drafts from,
    # concatenated, fc taking them to one feature; () EAGLE-1/EAGLE-2's final-normed feature.
    target_layers: tuple[int, ...] = ()
    rope_scaling: dict | None = None  # as a published head's config names it (Llama 3.1's "llama3"), else none

    @property
    def feature_size(self) -> int:
        """The width of a token's features as the target sends them."""
        return self.hidden_size * max(1, len(self.target_layers))

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
                           rope_scaling=self.rope_scaling, max_position_embeddings=self.max_position_embeddings)

    def save(self, directory: Path) -> None:
        (directory / CONFIG_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path) -> EagleConfig:
        fields = json.loads((Path(directory) / CONFIG_FILE).read_text())
        return cls(**{**fields, "target_layers": tuple(fields.get("target_layers", ()))})
