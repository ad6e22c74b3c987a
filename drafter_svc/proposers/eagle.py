"""eagle: an EAGLE head drafts from the target's features (see drafter_svc.models.eagle_drafter), each token
with the head's probability of it as its estimate. The target sends the features to this method only.

With `with_ngram` (FastDeploy's name for it), the n-gram prompt lookup's chain is merged into the head's tree
under the same budget: the head guesses what the model would say, the lookup what the text said before, and
where a text repeats itself (a role-play that echoes its prompt) the lookup is right more often than a head
of ~4M parameters."""
from __future__ import annotations

from dataclasses import replace

from drafter_svc.proposers.base import DraftRequest
from drafter_svc.proposers.model_proposer import ModelProposer
from drafter_svc.proposers.ngram import NgramIndex, prior_acceptance
from drafter_svc.sequences import SequenceState
from specd.drafts import DraftTree
from specd.model_store import DEFAULT_MODEL
from specd.options import Option, OptionSchema

NGRAM_LOOKUP = (2, 5)  # the shortest and longest suffix looked up: the ngram method's defaults


class EagleProposer(ModelProposer):
    schema = OptionSchema("eagle", (
        Option("use_tree_spec", "bool", True, help="draft EAGLE-2's dynamic tree (else a chain)"),
        Option("tree_top_k", "int", 4, minimum=1, maximum=16,
               help="tree: the likeliest children each depth keeps, across the depth's nodes"),
        Option("max_tree_depth", "int", 6, minimum=1, maximum=64, help="tree: the deepest draft token"),
        Option("min_token_prob", "float", 0.1, minimum=0.0, maximum=1.0,
               help="least estimated chance of a draft token: the head's probabilities multiplied down its "
                    "path (as suffix's); drafting stops where none is left, saving the head's forwards"),
        Option("with_ngram", "bool", True,
               help="merge the n-gram prompt lookup's chain into the head's draft (a path both propose once), "
                    "the likeliest nodes of the two within the budget"),
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
        self._ngram_indexes: dict[str, NgramIndex] = {}  # by sequence id (its proposer_state is the head's)

    def propose(self, batch: list[DraftRequest]) -> list[DraftTree]:
        drafts = self.model.propose(batch)
        return [self._with_ngram(request, draft) if request.options["with_ngram"] and request.max_tokens else draft
                for request, draft in zip(batch, drafts)]

    def release(self, sequence: SequenceState) -> None:
        self._ngram_indexes.pop(sequence.sequence_id, None)
        super().release(sequence)

    def _with_ngram(self, request: DraftRequest, draft: DraftTree) -> DraftTree:
        """`draft` and the lookup's chain as one tree, each chain token estimated by its match's length."""
        sequence = request.sequence
        index = self._ngram_indexes[sequence.sequence_id] = NgramIndex.of(
            sequence, self._ngram_indexes.get(sequence.sequence_id))
        match = index.longest_match(sequence.tokens, *NGRAM_LOOKUP, request.max_tokens)
        if match is None or not match.continuation:
            return draft
        chain = DraftTree.chain(match.continuation, [prior_acceptance(match.length)] * len(match.continuation))
        return DraftTree.merge([draft, chain], request.max_tokens)[0]
