"""Suffix decoding (Oliaro et al., SuffixDecoding; ArcticInference's suffix_decoding, vLLM's `suffix`
method): continue the text the way its latest tokens continued before.

Suffix trees count what followed what: one per request over its prompt and output, one per corpus scope
over the outputs of earlier requests of that scope (SpeculativeConfig.corpus_scope; the newest
`max_cached_requests` outputs of all scopes), and the warm corpus every scope starts from
(`corpus_index`: searched as a tree, kept as a suffix array, so a corpus of millions of tokens fits). A tree holds every substring of up to `TREE_DEPTH` tokens, each node counting
the occurrences through it.
To propose, the last `match_len` tokens of the sequence are looked up in each tree for every
`match_len` that occurs; from the node reached, the likeliest continuations are expanded best first
(a child's chance is its share of its siblings' counts, a node's the product down its path) while a
path stays at least `min_token_prob` likely, up to `match_len × max_spec_factor + max_spec_offset`
tokens: a longer match is more specific, so it earns a longer draft. The draft that expects the most
accepted tokens (its nodes' chances summed) wins. Nodes go out best first, as the target expects, each
estimated at its count share scaled by how much matched context backs it (`MATCH_HALF_TRUST`).
"""
from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterable

from drafter_svc.proposers.base import DraftRequest
from drafter_svc.proposers.corpus_index import CorpusIndex
from drafter_svc.proposers.scoped_trees import ScopedTrees
from drafter_svc.proposers.suffix_tree import TREE_DEPTH, Speculation, SuffixTree, speculate
from drafter_svc.proposers.text_index import TextIndex
from drafter_svc.sequences import SequenceState
from specd.drafts import DraftTree
from specd.options import Option, OptionSchema

MAX_CACHED_REQUESTS = 10_000  # outputs the scopes' trees keep in all, newest first (vLLM's default)
# The scopes' trees' size bound in nodes, all together (~0.3 KB each in Python): past it, the oldest outputs go first.
MAX_GLOBAL_NODES = 1_000_000
# A draft token's estimate is its count share times m / (m + half), m the matched tokens behind it (a token at
# depth d of a draft from an m-token match continues an (m + d - 1)-token match once its ancestors are
# accepted), `half` by where the match is: what followed the last m tokens before recurs more often the longer
# m is, and more often in the request's own text than in other texts. The share alone estimates a continuation
# seen once at 1, whatever backs it. Measured by replaying every output position of 26 Spec-Bench prompts
# (greedy, smollm2-135m-instruct, warm corpus): a token's chance of acceptance (its parent accepted) over its
# share was m / (m + 0.65) in the request's own text at every m from 1 to 16 (0.65 at 1, 0.96 at 16), and
# 0.3-0.6 below 4 and 0.7-0.9 from 8 in earlier outputs and the warm corpus. Under load only likely tokens pay
# for themselves, and the target's own calibration is by depth alone: scaled by the share alone, a long copy
# of the request's text (accepted 90%) was estimated as a one-token guess from the corpus (25%).
MATCH_HALF_TRUST = {"own": 0.65, "other": 2.0}


class SuffixProposer:
    """Suffix-tree drafts from the request's own text and from earlier requests' outputs."""

    schema = OptionSchema("suffix", (
        Option("max_tree_depth", "int", TREE_DEPTH, minimum=1, maximum=TREE_DEPTH,
               help="longest match and deepest draft, in tokens"),
        Option("max_spec_factor", "float", 1.0, minimum=0.0,
               help="draft tokens per matched token: a match of n tokens drafts up to n x this + max_spec_offset"),
        Option("max_spec_offset", "float", 0.0, help="added to the draft budget of every match"),
        Option("min_token_prob", "float", 0.1, minimum=0.0, maximum=1.0,
               help="least estimated chance of a draft token (the product of the count shares down its path)"),
        Option("use_tree_spec", "bool", True, help="draft a tree of the likeliest continuations (else a chain)"),
    ), learns_outputs=True)

    def __init__(self, max_cached_requests: int = MAX_CACHED_REQUESTS, max_global_nodes: int = MAX_GLOBAL_NODES,
                 warm_outputs: Iterable[list[int]] = ()):
        """`warm_outputs`: the warm corpus (drafter_svc.warm_corpus), drafted from in every scope beside its
        outputs' tree and never pushed out by what is served."""
        self.max_cached_requests = max_cached_requests
        if max_cached_requests == 0:  # no outputs kept: whole outputs teach it nothing
            self.schema = dataclasses.replace(SuffixProposer.schema, learns_outputs=False)
        self.max_global_nodes = max_global_nodes
        self._trees = ScopedTrees(SuffixTree)  # by corpus scope: its finished requests' outputs
        self._cached: deque[tuple[str, list[int]]] = deque()  # the outputs in the trees and their scopes, oldest first
        self.corpus = CorpusIndex(list(warm_outputs), TREE_DEPTH)

    def propose(self, batch: list[DraftRequest]) -> list[DraftTree]:
        return [self._propose_one(request) for request in batch]

    def release(self, sequence: SequenceState) -> None:
        """A finished request's output joins its scope's tree."""
        self._remember(sequence.corpus_scope, sequence.tokens[sequence.prompt_length:])

    def outputs_tree(self, scope: str) -> SuffixTree | None:
        """The tree of the outputs of `scope`'s finished requests (None before its first)."""
        return self._trees.get(scope)

    def _remember(self, scope: str, output: list[int]) -> None:
        """`output` joins `scope`'s tree; the oldest of any scope go past the bounds."""
        if self.max_cached_requests == 0 or not output:
            return
        self._trees.change(scope, lambda tree: tree.add(output))
        self._cached.append((scope, output))
        while self._cached and (len(self._cached) > self.max_cached_requests
                                or self._trees.num_nodes > self.max_global_nodes):
            oldest_scope, oldest = self._cached.popleft()
            self._trees.change(oldest_scope, lambda tree: tree.remove(oldest))

    def sizes(self) -> dict[str, int]:
        return {"global_tree_nodes": self._trees.num_nodes, "global_tree_requests": len(self._cached),
                "corpus_scopes": len(self._trees), "corpus_tokens": self.corpus.num_tokens}

    def _propose_one(self, request: DraftRequest) -> DraftTree:
        seq, options = request.sequence, request.options
        if request.max_tokens == 0:  # an update alone (a finished sequence's last tokens): the next ask indexes it
            return DraftTree()
        local = seq.proposer_state
        if local is None or local.epoch != seq.epoch:
            local = seq.proposer_state = TextIndex(TREE_DEPTH, seq.epoch)
        local.sync(seq.tokens)
        longest = options["max_tree_depth"]
        outputs = self._trees.get(seq.corpus_scope)
        candidates = [*(("own", n, node) for n, node in local.matches(seq.tokens, longest)),
                      *(("other", n, node) for n, node in (outputs.matches(seq.tokens, longest) if outputs else ())),
                      *(("other", n, node) for n, node in self.corpus.matches(seq.tokens, longest))]
        budgets = [min(request.max_tokens, math.floor(match_len * options["max_spec_factor"]
                                                      + options["max_spec_offset"])) for _, match_len, _ in candidates]
        # The best-scoring draft wins, the first listed on a tie. A draft scores at most its budget (each
        # node's chance is at most 1), so the largest budgets are expanded first and a match whose budget
        # cannot beat the best so far ends the search, since the budgets only fall from there: the same draft
        # in about half the time (every output position of 26 Spec-Bench prompts: 0.45 ms a proposal, 0.25 ms).
        best, best_at = Speculation(DraftTree(), 0.0), len(candidates)
        for at in sorted(range(len(candidates)), key=lambda at: (-budgets[at], at)):
            if budgets[at] <= 0 or (budgets[at], -at) <= (best.score, -best_at):
                break
            _, _, node = candidates[at]
            found = speculate(node, budgets[at], options["min_token_prob"], options["use_tree_spec"], longest)
            if (found.score, -at) > (best.score, -best_at):
                best, best_at = found, at
        if best_at == len(candidates):
            return DraftTree()
        where, match_len, _ = candidates[best_at]
        return trusted(best.draft, where, match_len)


def trusted(draft: DraftTree, where: str, match_len: int) -> DraftTree:
    """`draft` (count shares) drafted from a `match_len`-token match in the request's own text (`where`
    "own") or in other texts ("other"), each token's estimate scaled by the match behind it."""
    half = MATCH_HALF_TRUST[where]
    return draft.with_probs([prob * (match_len + depth - 1) / (match_len + depth - 1 + half)
                             for prob, depth in zip(draft.probs, draft.depths())])
