"""Counting suffix trees, shared by the drafters that continue text the way it continued before
(`suffix`, `trie`): every substring of up to `depth` tokens of the texts added, as paths from the
root, each node counting the occurrences through it; and the best-first expansion of what followed
a node."""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from collections.abc import Callable
from typing import Protocol

from specd.drafts import ROOT, DraftTree

TREE_DEPTH = 24  # the longest substring a tree holds by default: vLLM's default suffix max_tree_depth


class Node(Protocol):
    """What `speculate` expands: a substring's node, in a tree or in an index that works nodes out when asked."""
    count: int  # occurrences of the substring

    def continuations(self, min_share: float) -> tuple[int, list[tuple[int, Node]]]:
        """How often a token followed the substring, and the tokens that did with their nodes: every one, or
        (an index that finds them without the rest) at least those that did `min_share` of those times."""


class SuffixNode:
    __slots__ = ("children", "count")

    def __init__(self):
        # Most nodes of a deep tree are leaves: a dict only once there is a child saves ~30% of indexing.
        self.children: dict[int, SuffixNode] | None = None
        self.count = 0  # occurrences of the substring this node ends

    def child(self, token: int) -> SuffixNode | None:
        return self.children.get(token) if self.children else None

    def continuations(self, min_share: float) -> tuple[int, list[tuple[int, SuffixNode]]]:
        return counted(self.children)


class SuffixTree:
    """Every substring of up to `depth` tokens of the texts added, as paths from the root."""

    def __init__(self, depth: int = TREE_DEPTH):
        self.depth = depth
        self.root = SuffixNode()
        self.num_nodes = 0
        self.generation = 0  # bumped when nodes are pruned: frontiers held from before may be cut off

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

    def node(self, substring: list[int]) -> SuffixNode | None:
        """The node `substring` ends at, if the tree holds it."""
        node = self.root
        for token in substring:
            node = node.child(token)
            if node is None:
                return None
        return node

    def matches(self, tokens: list[int], longest: int) -> list[tuple[int, SuffixNode]]:
        return suffix_matches(self.node, tokens, min(longest, self.depth))


    def prune(self, below: int) -> None:
        """Drop every node fewer than `below` occurrences pass through (and what hangs from it)."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            for token, child in list((node.children or {}).items()):
                if child.count < below:
                    del node.children[token]
                    self.num_nodes -= _subtree_size(child)
                else:
                    stack.append(child)
        self.generation += 1


def suffix_matches(node_of: Callable[[list[int]], Node | None], tokens: list[int],
                   longest: int) -> list[tuple[int, Node]]:
    """(n, node) for each n up to `longest` whose last-n-token substring of `tokens` has a node (`node_of`),
    shortest first; a substring of one that has, has too, so the search stops at the first n that has not."""
    found = []
    for n in range(1, min(longest, len(tokens)) + 1):
        node = node_of(tokens[len(tokens) - n:])
        if node is None:
            break
        found.append((n, node))
    return found


def counted(children: dict[int, Node] | None) -> tuple[int, list[tuple[int, Node]]]:
    """A node's `continuations` from its children: how often a token followed it, and every child."""
    items = list((children or {}).items())
    return sum(child.count for _, child in items), items


def _subtree_size(node: SuffixNode) -> int:
    size, stack = 0, [node]
    while stack:
        size += 1
        stack.extend((stack.pop().children or {}).values())
    return size


def _likeliest_first(item: tuple[int, Node]) -> tuple[int, int]:
    token, child = item
    return -child.count, token


@dataclass(frozen=True)
class Speculation:
    draft: DraftTree
    score: float  # tokens it is expected to have accepted: its nodes' chances summed


def speculate(node: Node, budget: int, min_token_prob: float, tree_mode: bool, max_depth: int) -> Speculation:
    """The likeliest continuations of the substring `node` ends: best first, each node's chance the
    product of its siblings' count shares down its path, none below `min_token_prob`; a tree of up
    to `budget` nodes, or in path mode a chain that follows each node's likeliest child."""
    tokens, parents, probs, score = [], [], [], 0.0
    frontier: list[tuple[float, int, int, int, float, Node, int]] = []  # -chance, tie, parent, token, ...
    tie = 0

    def offer(parent_node: Node, parent: int, chance: float, depth: int) -> None:
        nonlocal tie
        total, children = parent_node.continuations(min_token_prob / chance)
        likely = [item for item in children if chance * (item[1].count / total) >= min_token_prob]
        if not likely:
            return
        # the likeliest first, ties by token: the same draft whatever order a node keeps its children in
        if tree_mode:
            likely.sort(key=_likeliest_first)
        else:
            likely = [min(likely, key=_likeliest_first)]
        for token, child in likely:
            share = child.count / total
            heapq.heappush(frontier, (-chance * share, tie, parent, token, share, child, depth))
            tie += 1

    offer(node, ROOT, 1.0, 1)
    while frontier and len(tokens) < budget:
        negative_chance, _, parent, token, share, child, depth = heapq.heappop(frontier)
        tokens.append(token)
        parents.append(parent)
        probs.append(share)
        score -= negative_chance
        if depth < max_depth and len(tokens) < budget:  # a full draft takes no more children
            offer(child, len(tokens) - 1, -negative_chance, depth + 1)
    return Speculation(DraftTree(tuple(tokens), tuple(parents), tuple(probs), score), score)
