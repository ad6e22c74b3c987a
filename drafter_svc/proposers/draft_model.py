"""draft_model: a smaller causal LM that shares the target's tokenizer drafts a chain (see
drafter_svc.models.draft_lm), each token with the draft model's probability of it as its estimate."""
from __future__ import annotations

from drafter_svc.proposers.model_proposer import ModelProposer
from specd.model_store import DEFAULT_MODEL
from specd.options import Option, OptionSchema


class DraftModelProposer(ModelProposer):
    schema = OptionSchema("draft_model", (
        Option("min_token_prob", "float", 0.1, minimum=0.0, maximum=1.0,
               help="end the chain where the draft model's probabilities multiplied down it fall below this "
                    "(as suffix's and eagle's)"),
    ))

    def __init__(self, model: str = DEFAULT_MODEL, num_layers: int | None = None, device: str = "cpu",
                 dtype: str = "float32", kv_cache_tokens: int = 65536, num_threads: int | None = None):
        """`model`: a directory, a .gguf file or a known name; `num_layers`: only its first layers (the
        target's own, for a self-speculative draft)."""
        from drafter_svc.models.draft_lm import DraftLM  # torch: loaded only where a model is served
        self.model = DraftLM(model, num_layers, device, dtype, kv_cache_tokens, num_threads)
