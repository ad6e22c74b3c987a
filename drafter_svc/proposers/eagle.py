"""eagle: an EAGLE head drafts from the target's features (see drafter_svc.models.eagle_drafter), each token
with the head's probability of it as its estimate. The target sends the features to this method only."""
from __future__ import annotations

from dataclasses import replace

from drafter_svc.proposers.model_proposer import ModelProposer
from specd.model_store import DEFAULT_MODEL
from specd.options import Option, OptionSchema


class EagleProposer(ModelProposer):
    schema = OptionSchema("eagle", (
        Option("use_tree_spec", "bool", True, help="draft EAGLE-2's dynamic tree (else a chain)"),
        Option("tree_top_k", "int", 4, minimum=1, maximum=16,
               help="tree: the likeliest children each depth keeps, across the depth's nodes"),
        Option("max_tree_depth", "int", 6, minimum=1, maximum=64, help="tree: the deepest draft token"),
        Option("min_token_prob", "float", 0.1, minimum=0.0, maximum=1.0,
               help="least estimated chance of a draft token: the head's probabilities multiplied down its "
                    "path (as suffix's); drafting stops where none is left, saving the head's forwards"),
    ), wants_features=True)

    def __init__(self, head: str | None = None, model: str = DEFAULT_MODEL, device: str = "cpu",
                 dtype: str = "float32", kv_cache_tokens: int = 65536, num_threads: int | None = None):
        """`head`: a head directory (`specd train eagle`, or one EAGLE's authors published); None: the one
        shipped for `model`."""
        from drafter_svc.models.eagle_drafter import EagleDrafter  # torch: loaded only where a model is served
        from drafter_svc.models.heads import shipped_head
        self.model = EagleDrafter(head or shipped_head(model), model, device, dtype, kv_cache_tokens, num_threads)
        # An EAGLE-3 head drafts from some of the target's layers: the target is told which when it asks.
        self.schema = replace(EagleProposer.schema, feature_layers=self.model.feature_layers)
