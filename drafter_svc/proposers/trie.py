"""MindIE's memory_decoding (after PIA's lookahead cache): a frequency trie over the token history of
prompts and outputs, global across requests (across those of one corpus scope).

Every window of the text, its first token then up to `branch_length` + 1 more, is a path in the trie
(so the trie is a suffix tree of that depth), each node counting the windows through it. A request's
prompt is counted for that request alone and dropped when it ends; outputs are counted for every request
of its scope (SpeculativeConfig.corpus_scope), as they are generated, in the scope's trie; a warm corpus,
in a trie of its own, counts for every scope. To propose, the last two tokens are looked up (the last one
if the two never occurred together) in all the counts at once, and the most frequent continuations are
expanded best first: a tree of up to `decoding_length` nodes, at most `branch_length` deep, or a chain of
each node's most frequent child. With `dynamic_algo` the length follows how much of the sequence's recent
drafts was accepted. Each token's estimate is its share of its siblings' counts; the target's cost
model has the last word on what is verified. Past `max_nodes` in all the tries, the scopes' rarely used
branches go.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

from drafter_svc.proposers.base import DraftRequest
from drafter_svc.proposers.scoped_trees import ScopedTrees
from drafter_svc.proposers.suffix_tree import SuffixNode, SuffixTree, counted, speculate
from drafter_svc.proposers.text_index import TextIndex, TextNode
from drafter_svc.sequences import SequenceState
from specd.drafts import DraftTree
from specd.options import Option, OptionSchema

MAX_BRANCH_LENGTH = 12  # PIA's and MindIE's default branch length, and its most here
KEY_LENGTH = 2  # tokens looked up: the last two, falling back to the last one
MAX_TRIE_NODES = 2_000_000  # the tries' bound, all together (~0.3 KB a node in Python)
# The share of the bound a warm corpus may fill; the rest is the outputs'. A trim walks the tries it prunes
# (0.9 s of a core at 1M nodes, which slows the target's forward on a small CPU for longer), so it must be
# rare: with the warm corpus at four fifths of a bound of 1M (when it was trimmed too), the trie of a
# `bench serve` run went over it after 205 of its 480 requests (the outputs of 2026-12-02's run, replayed),
# in the round at 32 clients where `trie` ran at 0.90x `none` (1.05x the round before). With 1.2M nodes
# free, ~1,000 such requests come before the first trim.
WARM_SHARE = 0.4
TRIM_TO = 0.8  # the share of the bound a trim brings the tries back under


class MergedNode:
    """One token string in several tries, counted in all of them."""
    __slots__ = ("nodes", "count", "_children")

    def __init__(self, nodes: list[SuffixNode | TextNode]):
        self.nodes = nodes
        self.count = sum(node.count for node in nodes)
        self._children: dict[int, Node] | None = None

    @property
    def children(self) -> dict[int, Node]:
        """Merged once, when first asked (the lookup asks, then `speculate` again)."""
        if self._children is None:
            merged: dict[int, list[SuffixNode | TextNode]] = {}
            for node in self.nodes:
                for token, child in (node.children or {}).items():
                    merged.setdefault(token, []).append(child)
            self._children = {token: merged_node(nodes) for token, nodes in merged.items()}
        return self._children

    def continuations(self, min_share: float) -> tuple[int, list[tuple[int, Node]]]:
        return counted(self.children)


Node = SuffixNode | TextNode | MergedNode  # what `speculate` can expand


def merged_node(nodes: list[SuffixNode | TextNode]) -> Node:
    """The nodes of one token string as one: the node itself where only one trie holds it."""
    return nodes[0] if len(nodes) == 1 else MergedNode(nodes)


class TrieState:
    """What the trie drafter keeps per sequence: its prompt, indexed as a trie of its own (`TextIndex`),
    and where its output stands in its scope's trie."""

    def __init__(self, epoch: int):
        self.epoch = epoch
        self.prompt = TextIndex(KEY_LENGTH + MAX_BRANCH_LENGTH)
        self.outputs: SuffixTree | None = None  # its scope's trie, which the frontier points into
        self.output_frontier: list[SuffixNode] = []
        self.generation = 0  # of that trie when the frontier was taken
        self.num_tokens = 0


class TrieProposer:
    """Frequency-trie drafts over the request's prompt and every request's output."""

    schema = OptionSchema("trie", (
        Option("decoding_length", "int", 16, minimum=1, maximum=16, help="the most draft tokens (MindIE's)"),
        Option("branch_length", "int", MAX_BRANCH_LENGTH, minimum=1, maximum=MAX_BRANCH_LENGTH,
               help="the deepest draft branch, in tokens"),
        Option("dynamic_algo", "bool", False,
               help="draft length follows how much of the sequence's recent drafts was accepted"),
        Option("use_tree_spec", "bool", True, help="draft a tree of the most frequent continuations (else a chain)"),
    ), learns_outputs=True)

    def __init__(self, max_nodes: int = MAX_TRIE_NODES, warm_outputs: Iterable[list[int]] = ()):
        """`warm_outputs`: outputs every scope starts with (drafter_svc.warm_corpus), in order while they fit
        in WARM_SHARE of the bound (a corpus may hold far more: taking in ~60 us a token, a large one would
        cost a minute at every start)."""
        self.max_nodes = max_nodes
        self.warm_trie = SuffixTree(KEY_LENGTH + MAX_BRANCH_LENGTH)
        for output in warm_outputs:
            if self.warm_trie.num_nodes > WARM_SHARE * self.max_nodes:
                break
            self.warm_trie.add(output)
        self._tries = ScopedTrees(lambda: SuffixTree(KEY_LENGTH + MAX_BRANCH_LENGTH))  # by corpus scope: its outputs

    def propose(self, batch: list[DraftRequest]) -> list[DraftTree]:
        drafts = [self._propose_one(request) for request in batch]
        if self.num_nodes > self.max_nodes:
            self._trim()
        return drafts

    def release(self, sequence: SequenceState) -> None:
        """The prompt's counts go with the sequence's state; its output stays in its scope's trie."""

    @property
    def num_nodes(self) -> int:
        return self.warm_trie.num_nodes + self._tries.num_nodes

    def sizes(self) -> dict[str, int]:
        return {"trie_nodes": self.num_nodes, "corpus_scopes": len(self._tries)}

    def _propose_one(self, request: DraftRequest) -> DraftTree:
        seq, options = request.sequence, request.options
        state = self._synced(seq)
        if request.max_tokens == 0:
            return DraftTree()
        node = self._lookup(state, seq.tokens)
        if node is None:
            return DraftTree()
        budget = min(request.max_tokens, options["decoding_length"])
        if options["dynamic_algo"]:
            history = seq.acceptance
            rate = (history.accepted + 1) / (history.accepted + history.rejected + 2)
            budget = max(1, math.ceil(budget * rate))
        draft = speculate(node, budget, 0.0, options["use_tree_spec"], options["branch_length"]).draft
        seq.expect(draft.first_path())
        return draft

    def _synced(self, seq: SequenceState) -> TrieState:
        """`seq`'s state with every token counted: the prompt's in its own trie, the output's in its scope's."""
        state = seq.proposer_state
        if state is None or state.epoch != seq.epoch:
            state = seq.proposer_state = TrieState(seq.epoch)
        if len(state.prompt.tokens) < seq.prompt_length:
            state.prompt.sync(seq.tokens[:seq.prompt_length])

        def count_on(outputs: SuffixTree) -> None:
            # A trie new to the state, or pruned since: the output's tokens are counted on from here.
            if state.outputs is not outputs or state.generation != outputs.generation:
                state.outputs, state.output_frontier, state.generation = outputs, [], outputs.generation
            for token in seq.tokens[max(state.num_tokens, seq.prompt_length):]:
                state.output_frontier = outputs.extend(state.output_frontier, token)

        self._tries.change(seq.corpus_scope, count_on)
        state.num_tokens = len(seq.tokens)
        return state

    def _lookup(self, state: TrieState, tokens: list[int]) -> Node | None:
        """The node of the last KEY_LENGTH tokens in the prompt's, the warm and the scope's trie together (of
        the last one where the two never occurred together), if anything ever followed it."""
        for length in range(min(KEY_LENGTH, len(tokens)), 0, -1):
            found = [node for tree in (state.prompt, self.warm_trie, state.outputs)
                     if (node := tree.node(tokens[-length:])) is not None]
            if found and (merged := merged_node(found)).children:
                return merged
        return None

    def _trim(self) -> None:
        """Drop the scopes' rarely used branches until the tries are back under TRIM_TO of the bound (the warm
        trie, within WARM_SHARE of it, stays whole); a scope's trie left empty goes."""
        below = 2
        while self.num_nodes > TRIM_TO * self.max_nodes:
            for scope in self._tries.scopes():
                self._tries.change(scope, lambda trie: trie.prune(below))
            below *= 2

