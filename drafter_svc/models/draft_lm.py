"""A smaller causal LM with the target's tokenizer drafts a chain, one token at a time.

Every sequence of the batch moves together: one forward catches each sequence's KV cache up with its
committed tokens (a prompt, or the tokens accepted since the last step) and gives the first draft
token; each further forward feeds the batch's last draft tokens back. A draft token is the draft
model's argmax, and its probability there is the estimate that the target accepts it. Drafts are
deterministic given the text, so the target verifies them losslessly for greedy and sampled requests
alike. With no second model at hand, the target's own first layers with its final norm and LM head
(`num_layers`, LayerSkip's early exit) make a self-speculative draft model.
"""
from __future__ import annotations

import logging
import math

import torch

from drafter_svc.models import draft_kv
from drafter_svc.models.base import ModelDrafter
from drafter_svc.proposers.base import DraftRequest
from engine.config import EngineConfig
from engine.runner import ModelRunner, SequenceInput
from specd.drafts import DraftTree
from specd.model_store import DEFAULT_MODEL, resolve_model

log = logging.getLogger(__name__)


class DraftLM(ModelDrafter):
    """Chains from a draft LM run on its own paged KV cache, batched across sequences."""

    def __init__(self, model: str = DEFAULT_MODEL, num_layers: int | None = None, device: str = "cpu",
                 dtype: str = "float32", kv_cache_tokens: int = 65536, num_threads: int | None = None):
        super().__init__()
        engine = EngineConfig.parse(device, dtype)
        self.runner = ModelRunner(resolve_model(model), kv_cache_tokens=kv_cache_tokens, engine=engine,
                                  num_threads=num_threads, num_layers=num_layers)
        log.info("draft model %s (%d layers) on %s %s, KV cache %d tokens", model,
                 self.runner.config.num_hidden_layers, engine.device, engine.dtype_name, kv_cache_tokens)

    def _draft(self, batch: list[DraftRequest]) -> dict[int, DraftTree]:
        """Each request's chain by id(sequence), up to its max_tokens and the model's context."""
        batch = [r for r in batch if 0 < len(r.sequence.tokens) < self.runner.max_context_length]
        catch_ups = [draft_kv.catch_up(r.sequence, self.runner.allocator) for r in batch]
        in_vocab = [all(0 <= t < self.runner.vocab_size for t in c.token_ids) for c in catch_ups]
        batch = [r for r, ok in zip(batch, in_vocab) if ok]
        catch_ups = [c for c, ok in zip(catch_ups, in_vocab) if ok]
        if not batch:
            return {}
        logits = self.runner.forward([SequenceInput(r.sequence.sequence_id, c.token_ids, c.start, 1)
                                      for r, c in zip(batch, catch_ups)])  # [B, V]
        budgets = [min(r.max_tokens, self.runner.max_context_length - len(r.sequence.tokens)) for r in batch]
        tokens: list[list[int]] = [[] for _ in batch]
        probs: list[list[float]] = [[] for _ in batch]
        live = [i for i, budget in enumerate(budgets) if budget > 0]
        rows = live
        while live:
            best = torch.softmax(logits[rows], dim=-1).max(dim=-1)
            for i, token, prob in zip(live, best.indices.tolist(), best.values.tolist()):
                tokens[i].append(token)
                probs[i].append(prob)
            live = [i for i in live if len(tokens[i]) < budgets[i]
                    and math.prod(probs[i]) >= batch[i].options["min_token_prob"]]
            if live:
                logits = self.runner.forward([SequenceInput(batch[i].sequence.sequence_id, tokens[i][-1:],
                                                            len(batch[i].sequence.tokens) + len(tokens[i]) - 1, 1)
                                              for i in live])
                rows = list(range(len(live)))
        for request, chain in zip(batch, tokens):
            draft_kv.cached(request.sequence, chain[:-1])  # the last draft token was never fed
        return {id(r.sequence): DraftTree.chain(chain, p) for r, chain, p in zip(batch, tokens, probs) if chain}
