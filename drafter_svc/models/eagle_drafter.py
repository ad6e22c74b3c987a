"""EAGLE drafts: the head (engine.eagle, or engine.eagle3 for an EAGLE-3 head) runs on its own paged KV cache
over pairs (x_{p+1}, f_p) of each sequence's committed tokens and the target's features, then drafts a chain
or a tree from its own estimated features, batched across sequences.

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
from engine.features import FeatureLog, from_bytes
from engine.runner import SequenceInput
from specd.drafts import ROOT, DraftTree
from specd.model_store import resolve_model

log = logging.getLogger(__name__)


@dataclass
class EagleState:
    """One sequence's features (f_0 .. f_{features.length-1}) and how many pairs the head's cache holds on them."""
    epoch: int
    features: FeatureLog = field(default_factory=FeatureLog)
    cached_pairs: int = 0  # pairs 0..cached_pairs-1, each on the target's own feature

    def take(self, sequence: SequenceState, feature_size: int) -> None:
        """The features the target sent since the last step; a piece that does not follow what is held
        (a resync) starts the features over from its position."""
        for update in sequence.new_features:
            if update.hidden_size != feature_size or update.start_position > self.features.length:
                continue  # a stranger's hidden size or a gap: keep what is held
            self.features.truncate(update.start_position)
            self.features.write(update.start_position, from_bytes(update.data, update.dtype, feature_size))
            self.cached_pairs = min(self.cached_pairs, update.start_position)
        sequence.new_features.clear()


@dataclass
class _Chain:
    request: DraftRequest
    state: EagleState
    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    reach: float = 1.0  # the probabilities of its tokens multiplied


class _Tree:
    """One sequence's growing draft tree: per node its token, parent (ROOT: the newest committed token), the
    head's probability of it given its parent, its path's probability (score) and depth."""

    def __init__(self, chain: _Chain, budget: int, root_estimate: torch.Tensor):
        self.chain, self.budget = chain, budget
        options = chain.request.options
        self.top_k, self.min_prob = options["tree_top_k"], options["min_token_prob"]
        self.max_depth = min(options["max_tree_depth"], budget)
        self.start = len(chain.request.sequence.tokens) - 1  # the position of a depth-1 node's pair
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.probs: list[float] = []
        self.scores: list[float] = []
        self.depths: list[int] = []
        self.frontier = [ROOT]  # the nodes the next rows of logits expand, in order
        self.estimates = {ROOT: root_estimate}  # node -> the head's estimate of the feature after it

    def expand(self, probs: torch.Tensor, draft_vocab: torch.Tensor, depth: int) -> None:
        """probs [len(frontier), V']: the frontier's children, of which the likeliest tree_top_k are kept."""
        top = probs.topk(min(self.top_k, probs.shape[-1]), dim=-1)
        candidates = sorted(((p * (1.0 if node == ROOT else self.scores[node]), node, int(draft_vocab[i]), p)
                             for node, ps, ids in zip(self.frontier, top.values.tolist(), top.indices.tolist())
                             for p, i in zip(ps, ids)), key=lambda c: -c[0])
        candidates = [c for c in candidates if c[0] >= self.min_prob]  # its path likely enough
        self.frontier = []
        for score, parent, token, prob in candidates[:self.top_k]:
            self.frontier.append(len(self.tokens))
            self.tokens.append(token)
            self.parents.append(parent)
            self.probs.append(prob)
            self.scores.append(score)
            self.depths.append(depth)

    def paths(self) -> tuple[list[int], list[int]]:
        """The frontier's nodes with all their ancestors, in node order (the frontier last), and each one's
        parent among them (-1: the root)."""
        kept = set()
        for node in self.frontier:
            while node != ROOT and node not in kept:
                kept.add(node)
                node = self.parents[node]
        nodes = sorted(kept)
        row = {node: i for i, node in enumerate(nodes)}
        return nodes, [row.get(self.parents[node], ROOT) for node in nodes]

    def parent_estimates(self, nodes: list[int]) -> torch.Tensor:
        """[len(nodes), D]: each node's input feature, its parent's estimate."""
        return torch.stack([self.estimates[self.parents[node]] for node in nodes])

    def draft(self) -> DraftTree:
        """The `budget` likeliest nodes, best first (a parent before its children: it is at least as likely)."""
        best = sorted(range(len(self.tokens)), key=lambda i: (-self.scores[i], self.depths[i]))[:self.budget]
        chosen = set(best)
        best = [i for i in best if all(a in chosen for a in self._ancestors(i))]
        index = {node: i for i, node in enumerate(best)}
        return DraftTree(tuple(self.tokens[i] for i in best), tuple(index.get(self.parents[i], ROOT) for i in best),
                         tuple(self.probs[i] for i in best))

    def _ancestors(self, node: int) -> list[int]:
        out = []
        while (node := self.parents[node]) != ROOT:
            out.append(node)
        return out


class EagleDrafter(ModelDrafter):
    def __init__(self, head: str, model: str, device: str = "cpu", dtype: str = "float32",
                 kv_cache_tokens: int = 65536, num_threads: int | None = None):
        super().__init__()
        engine = EngineConfig.parse(device, dtype)
        self.runner = EagleRunner(head, resolve_model(model), kv_cache_tokens=kv_cache_tokens,
                                  num_threads=num_threads, engine=engine)
        self.feature_layers = self.runner.model.eagle_config.target_layers  # () but for EAGLE-3
        self.feature_size = self.runner.model.eagle_config.feature_size  # a token's features as the target sends them
        log.info("EAGLE head %s (draft vocabulary %d) for %s on %s %s, KV cache %d pairs", head,
                 self.runner.model.eagle_config.draft_vocab_size, model, engine.device, engine.dtype_name,
                 kv_cache_tokens)

    def _state(self, sequence: SequenceState) -> EagleState:
        state = sequence.proposer_state
        if not isinstance(state, EagleState) or state.epoch != sequence.epoch:
            self.runner.allocator.free(sequence.sequence_id)
            state = sequence.proposer_state = EagleState(sequence.epoch)
        state.take(sequence, self.feature_size)
        return state

    def _draft(self, batch: list[DraftRequest]) -> dict[int, DraftTree]:
        """Catch every sequence's head cache up with its features (the last pair's logits give the first
        draft tokens), then grow each sequence's chain or tree."""
        ready, inputs, features = [], [], []
        for request in batch:
            sequence, state = request.sequence, self._state(request.sequence)
            n = len(sequence.tokens)
            if not 1 < n <= self.runner.max_context_length or state.features.length < n - 1:
                continue  # the target has not sent the features of every token before the newest yet
            first = min(state.cached_pairs, n - 2)  # at least the newest pair, for its logits
            new_tokens = sequence.tokens[first + 1:n]
            if not all(0 <= t < self.runner.vocab_size for t in new_tokens):
                continue
            self.runner.allocator.truncate(sequence.sequence_id, first)
            ready.append(_Chain(request, state))
            inputs.append(SequenceInput(sequence.sequence_id, new_tokens, first, num_logits=1))
            features.append(state.features.rows(first, n - 1))
        if not ready:
            return {}
        logits, g = self.runner.draft(inputs, torch.cat(features))  # logits [B, V'], g [T, D]
        for chain in ready:
            chain.state.cached_pairs = len(chain.request.sequence.tokens) - 1
        last_rows = torch.tensor(list(accumulate(len(i.token_ids) for i in inputs))) - 1
        g = g[last_rows]  # [B, D]: each sequence's estimate of the newest token's feature
        trees = [i for i, c in enumerate(ready) if self._budget(c) > 0 and c.request.options["use_tree_spec"]]
        chains = [i for i, c in enumerate(ready) if self._budget(c) > 0 and not c.request.options["use_tree_spec"]]
        drafts = self._grow_chains([ready[i] for i in chains], logits[chains], g[chains])
        drafts.update(self._grow_trees([ready[i] for i in trees], logits[trees], g[trees]))
        return drafts

    def _grow_chains(self, live: list[_Chain], logits: torch.Tensor, estimates: torch.Tensor) -> dict[int, DraftTree]:
        """Each chain one token a forward, on the head's cache: the argmax, fed back with the head's estimate."""
        chains = list(live)
        while live:
            best = torch.softmax(logits, dim=-1).max(dim=-1)
            drafted = self.runner.model.draft_vocab[best.indices].tolist()
            for chain, token, prob in zip(live, drafted, best.values.tolist()):
                chain.tokens.append(token)
                chain.probs.append(prob)
                chain.reach *= prob
            keep = [i for i, c in enumerate(live) if len(c.tokens) < self._budget(c)
                    and c.reach >= c.request.options["min_token_prob"]]
            live, estimates = [live[i] for i in keep], estimates[keep]
            if live:
                logits, estimates = self.runner.draft(
                    [SequenceInput(c.request.sequence.sequence_id, c.tokens[-1:],
                                   len(c.request.sequence.tokens) + len(c.tokens) - 2, 1) for c in live], estimates)
        return {id(c.request.sequence): DraftTree.chain(c.tokens, c.probs) for c in chains if c.tokens}

    def _grow_trees(self, growing: list[_Chain], logits: torch.Tensor, estimates: torch.Tensor) -> dict[int, DraftTree]:
        """EAGLE-2's dynamic trees: each depth keeps the `tree_top_k` likeliest children (a node's likelihood:
        the head's probabilities multiplied down its path) of the nodes the depth before kept; in the end the
        likeliest nodes, as many as the budget, make the draft. A depth is one forward over the kept paths of
        every sequence at once (each node sees its ancestors only), from the head's cache of real pairs."""
        trees = [_Tree(c, self._budget(c), g) for c, g in zip(growing, estimates)]
        live, depth = trees, 1
        while live:
            rows = torch.softmax(logits, dim=-1).split([len(t.frontier) for t in live])
            for tree, probs in zip(live, rows):
                tree.expand(probs, self.runner.model.draft_vocab, depth)
            live = [t for t in live if t.frontier and depth < t.max_depth]
            if live:
                paths = [t.paths() for t in live]
                logits, g = self.runner.draft(
                    [SequenceInput(t.chain.request.sequence.sequence_id, [t.tokens[i] for i in nodes], t.start,
                                   len(t.frontier), [t.start + t.depths[i] - 1 for i in nodes], parents)
                     for t, (nodes, parents) in zip(live, paths)],
                    torch.cat([t.parent_estimates(nodes) for t, (nodes, _) in zip(live, paths)]))
                for t, (nodes, _), rows_g in zip(live, paths, g.split([len(nodes) for nodes, _ in paths])):
                    t.estimates.update(zip(nodes, rows_g))
            depth += 1
        return {id(t.chain.request.sequence): t.draft() for t in trees}

    def _budget(self, chain: _Chain) -> int:
        return min(chain.request.max_tokens, self.runner.max_context_length - len(chain.request.sequence.tokens))
