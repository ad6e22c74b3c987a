"""Suffix decoding (Oliaro et al., SuffixDecoding; ArcticInference's suffix_decoding, vLLM's `suffix`
method): continue the text the way its latest tokens continued before.

Two suffix trees count what followed what: one per request over its prompt and output, and one
global tree over the outputs of earlier requests (the newest `max_cached_requests` of them). A tree
holds every substring of up to `TREE_DEPTH` tokens, each node counting the occurrences through it.
To propose, the last `match_len` tokens of the sequence are looked up in each tree for every
`match_len` that occurs; from the node reached, the likeliest continuations are expanded best first
(a child's chance is its share of its siblings' counts, a node's the product down its path) while a
path stays at least `min_token_prob` likely, up to `match_len × max_spec_factor + max_spec_offset`
tokens: a longer match is more specific, so it earns a longer draft. The draft that expects the most
accepted tokens (its nodes' chances summed) wins. Nodes go out best first, as the target expects.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from drafter_svc.proposers.base import DraftRequest
from drafter_svc.sequences import SequenceState
from specd.drafts import ROOT, DraftTree
from specd.options import Option, OptionSchema

TREE_DEPTH = 24  # the longest substring a tree holds: vLLM's default max_tree_depth, and its most here
MAX_CACHED_REQUESTS = 10_000  # outputs the global tree keeps, newest first (vLLM's default)
# The global tree's size bound in nodes (~0.3 KB each in Python): past it, the oldest outputs go first.
MAX_GLOBAL_NODES = 1_000_000


class SuffixNode:
    __slots__ = ("children", "count")

    def __init__(self):
        # Most nodes of a deep tree are leaves: a dict only once there is a child saves ~30% of indexing.
        self.children: dict[int, SuffixNode] | None = None
        self.count = 0  # occurrences of the substring this node ends

    def child(self, token: int) -> SuffixNode | None:
        return self.children.get(token) if self.children else None


class SuffixTree:
    """Every substring of up to `depth` tokens of the texts added, as paths from the root."""

    def __init__(self, depth: int = TREE_DEPTH):
        self.depth = depth
        self.root = SuffixNode()
        self.num_nodes = 0

    def extend(self, frontier: list[SuffixNode], token: int) -> list[SuffixNode]:
        """Count `token` after each substring that ends a text's last token: `frontier`, the nodes of
        its suffixes, shortest first ([] for a new text). Returns the frontier with `token` appended:
        O(depth)."""
        extended, created = [], 0
        append = extended.append  # the hot loop of indexing a prompt: ~24 nodes a token
        for node in (self.root, *frontier[:self.depth - 1]):
            children = node.children
            if children is None:
                child, created = SuffixNode(), created + 1
                node.children = {token: child}
            elif (child := children.get(token)) is None:
                child = children[token] = SuffixNode()
                created += 1
            child.count += 1
            append(child)
        self.num_nodes += created
        return extended

    def add(self, tokens: list[int]) -> None:
        frontier: list[SuffixNode] = []
        for token in tokens:
            frontier = self.extend(frontier, token)

    def remove(self, tokens: list[int]) -> None:
        """Uncount a text added before; nodes no text passes through any more go."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start:start + self.depth]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    del node.children[token]
                    self.num_nodes -= _subtree_size(child)
                    break
                node = child

    def matches(self, tokens: list[int], longest: int) -> list[tuple[int, SuffixNode]]:
        """(n, node) for each n up to `longest` whose last-n-token substring of `tokens` is in the tree;
        a substring of one that is, is too, so the search stops at the first n that is not."""
        found = []
        for n in range(1, min(longest, self.depth, len(tokens)) + 1):
            node = self.root
            for token in tokens[len(tokens) - n:]:
                node = node.child(token)
                if node is None:
                    return found
            found.append((n, node))
        return found


def _subtree_size(node: SuffixNode) -> int:
    size, stack = 0, [node]
    while stack:
        size += 1
        stack.extend((stack.pop().children or {}).values())
    return size


@dataclass
class LocalTree:
    """A sequence's own suffix tree, grown as its tokens arrive."""
    epoch: int  # of the SequenceState tokens it holds
    tree: SuffixTree = field(default_factory=SuffixTree)
    frontier: list[SuffixNode] = field(default_factory=list)  # the nodes of the sequence's suffixes
    num_tokens: int = 0

    def sync(self, tokens: list[int]) -> None:
        for token in tokens[self.num_tokens:]:
            self.frontier = self.tree.extend(self.frontier, token)
        self.num_tokens = len(tokens)


@dataclass(frozen=True)
class Speculation:
    draft: DraftTree
    score: float  # tokens it is expected to have accepted: its nodes' chances summed


def speculate(node: SuffixNode, budget: int, min_token_prob: float, tree_mode: bool, max_depth: int) -> Speculation:
    """The likeliest continuations of the substring `node` ends: best first, each node's chance the
    product of its siblings' count shares down its path, none below `min_token_prob`; a tree of up
    to `budget` nodes, or in path mode a chain that follows each node's likeliest child."""
    tokens, parents, probs, score = [], [], [], 0.0
    frontier: list[tuple[float, int, int, int, float, SuffixNode, int]] = []  # -chance, tie, parent, token, ...
    tie = 0

    def offer(parent_node: SuffixNode, parent: int, chance: float, depth: int) -> None:
        nonlocal tie
        if not parent_node.children:
            return
        total = sum(child.count for child in parent_node.children.values())
        children = parent_node.children.items() if tree_mode else \
            [max(parent_node.children.items(), key=lambda item: item[1].count)]
        for token, child in children:
            share = child.count / total
            if chance * share >= min_token_prob:
                heapq.heappush(frontier, (-chance * share, tie, parent, token, share, child, depth))
                tie += 1

    offer(node, ROOT, 1.0, 1)
    while frontier and len(tokens) < budget:
        negative_chance, _, parent, token, share, child, depth = heapq.heappop(frontier)
        tokens.append(token)
        parents.append(parent)
        probs.append(share)
        score -= negative_chance
        if depth < max_depth:
            offer(child, len(tokens) - 1, -negative_chance, depth + 1)
    return Speculation(DraftTree(tuple(tokens), tuple(parents), tuple(probs), score), score)


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
    ))

    def __init__(self, max_cached_requests: int = MAX_CACHED_REQUESTS, max_global_nodes: int = MAX_GLOBAL_NODES):
        self.max_cached_requests = max_cached_requests
        self.max_global_nodes = max_global_nodes
        self.global_tree = SuffixTree()
        self._cached: deque[list[int]] = deque()  # the outputs in the global tree, oldest first

    def propose(self, batch: list[DraftRequest]) -> list[DraftTree]:
        return [self._propose_one(request) for request in batch]

    def release(self, sequence: SequenceState) -> None:
        """A finished request's output joins the global tree; the oldest go past the bounds."""
        output = sequence.tokens[sequence.prompt_length:]
        if self.max_cached_requests == 0 or not output:
            return
        self.global_tree.add(output)
        self._cached.append(output)
        while self._cached and (len(self._cached) > self.max_cached_requests
                                or self.global_tree.num_nodes > self.max_global_nodes):
            self.global_tree.remove(self._cached.popleft())

    def sizes(self) -> dict[str, int]:
        return {"global_tree_nodes": self.global_tree.num_nodes, "global_tree_requests": len(self._cached)}

    def _propose_one(self, request: DraftRequest) -> DraftTree:
        seq, options = request.sequence, request.options
        local = seq.proposer_state
        if local is None or local.epoch != seq.epoch:
            local = seq.proposer_state = LocalTree(seq.epoch)
        local.sync(seq.tokens)
        longest = options["max_tree_depth"]
        candidates = list(enumerate(local.frontier[:longest], start=1))
        candidates += self.global_tree.matches(seq.tokens, longest)
        best = Speculation(DraftTree(), 0.0)
        for match_len, node in candidates:
            budget = min(request.max_tokens,
                         math.floor(match_len * options["max_spec_factor"] + options["max_spec_offset"]))
            if budget <= 0 or not node.children:
                continue
            found = speculate(node, budget, options["min_token_prob"], options["use_tree_spec"], longest)
            if found.score > best.score:
                best = found
        return best.draft
