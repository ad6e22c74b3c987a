"""EAGLE drafts: the head (engine.eagle) runs on its own paged KV cache over pairs (x_{p+1}, f_p) of each
sequence's committed tokens and the target's features, then drafts a chain from its own estimated
features, batched across sequences.

A sequence's head cache holds the pairs up to the newest feature the target sent (the features of
positions 0..n-2 for n committed tokens); the pairs a draft added (on estimated features) are cut off at
the next step, because the target's own features of the accepted tokens replace them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from drafter_svc.models.base import ModelDrafter
from drafter_svc.proposers.base import DraftRequest
from drafter_svc.sequences import SequenceState
from engine.config import EngineConfig
from engine.eagle import EagleRunner
from engine.features import from_bytes
from engine.runner import SequenceInput
from specd.drafts import DraftTree
from specd.model_store import resolve_model

log = logging.getLogger(__name__)


@dataclass
class EagleState:
    """One sequence's features (f_0 .. f_{length-1}) and how many pairs the head's cache holds on them."""
    epoch: int
    features: torch.Tensor | None = None  # [capacity, D]
    length: int = 0
    cached_pairs: int = 0  # pairs 0..cached_pairs-1, each on the target's own feature

    def take(self, sequence: SequenceState, hidden_size: int) -> None:
        """The features the target sent since the last step; a piece that does not follow what is held
        (a resync) starts the features over from its position."""
        for update in sequence.new_features:
            rows = from_bytes(update.data, update.dtype, hidden_size) if update.hidden_size == hidden_size else None
            if rows is None or update.start_position > self.length:
                continue  # a gap or a stranger's hidden size: keep what is held
            end = update.start_position + rows.shape[0]
            if self.features is None or end > self.features.shape[0]:
                grown = torch.empty(max(2 * end, 64), hidden_size, dtype=rows.dtype)
                if self.features is not None:
                    grown[:self.length] = self.features[:self.length]
                self.features = grown
            self.features[update.start_position:end] = rows
            self.length = end
            self.cached_pairs = min(self.cached_pairs, update.start_position)
        sequence.new_features.clear()


@dataclass
class _Chain:
    request: DraftRequest
    state: EagleState
    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)


class EagleDrafter(ModelDrafter):
    def __init__(self, head: str, model: str, device: str = "cpu", dtype: str = "float32",
                 kv_cache_tokens: int = 65536, num_threads: int | None = None):
        super().__init__()
        engine = EngineConfig.parse(device, dtype)
        self.runner = EagleRunner(head, resolve_model(model), kv_cache_tokens=kv_cache_tokens,
                                  num_threads=num_threads, engine=engine)
        self.hidden_size = self.runner.model.eagle_config.hidden_size
        log.info("EAGLE head %s (draft vocabulary %d) for %s on %s %s, KV cache %d pairs", head,
                 self.runner.model.eagle_config.draft_vocab_size, model, engine.device, engine.dtype_name,
                 kv_cache_tokens)

    def _state(self, sequence: SequenceState) -> EagleState:
        state = sequence.proposer_state
        if not isinstance(state, EagleState) or state.epoch != sequence.epoch:
            self.runner.allocator.free(sequence.sequence_id)
            state = sequence.proposer_state = EagleState(sequence.epoch)
        state.take(sequence, self.hidden_size)
        return state

    def _draft(self, batch: list[DraftRequest]) -> dict[int, DraftTree]:
        """Catch every sequence's head cache up with its features (the last pair's logits give the first
        draft token), then extend the chains one token a forward."""
        ready, inputs, features = [], [], []
        for request in batch:
            sequence, state = request.sequence, self._state(request.sequence)
            n = len(sequence.tokens)
            if not 1 < n <= self.runner.max_context_length or state.length < n - 1:
                continue  # the target has not sent the features of every token before the newest yet
            first = min(state.cached_pairs, n - 2)  # at least the newest pair, for its logits
            new_tokens = sequence.tokens[first + 1:n]
            if not all(0 <= t < self.runner.vocab_size for t in new_tokens):
                continue
            self.runner.allocator.truncate(sequence.sequence_id, first)
            ready.append(_Chain(request, state))
            inputs.append(SequenceInput(sequence.sequence_id, new_tokens, first, num_logits=1))
            features.append(state.features[first:n - 1])
        if not ready:
            return {}
        logits, g = self.runner.draft(inputs, torch.cat(features))  # logits [B, V'], g [T, D]
        for chain in ready:
            chain.state.cached_pairs = len(chain.request.sequence.tokens) - 1
        last_rows = torch.tensor(list(accumulate(len(i.token_ids) for i in inputs))) - 1
        drafting = [i for i, chain in enumerate(ready) if self._budget(chain) > 0]
        live, logits, estimates = [ready[i] for i in drafting], logits[drafting], g[last_rows[drafting]]
        while live:
            best = torch.softmax(logits, dim=-1).max(dim=-1)
            drafted = self.runner.model.draft_vocab[best.indices].tolist()
            for chain, token, prob in zip(live, drafted, best.values.tolist()):
                chain.tokens.append(token)
                chain.probs.append(prob)
            keep = [i for i, c in enumerate(live) if len(c.tokens) < self._budget(c)
                    and c.probs[-1] >= c.request.options["min_token_prob"]]
            live, estimates = [live[i] for i in keep], estimates[keep]
            if live:
                logits, estimates = self.runner.draft(
                    [SequenceInput(c.request.sequence.sequence_id, c.tokens[-1:],
                                   len(c.request.sequence.tokens) + len(c.tokens) - 2, 1) for c in live], estimates)
        return {id(c.request.sequence): DraftTree.chain(c.tokens, c.probs) for c in ready if c.tokens}

    def _budget(self, chain: _Chain) -> int:
        return min(chain.request.max_tokens, self.runner.max_context_length - len(chain.request.sequence.tokens))
