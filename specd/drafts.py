"""The one draft type: a token tree with an acceptance estimate per token.

Tokens are flat; each has the index of its parent (-1: the sequence's last committed token), and
parents come before their children. A chain is the tree whose every node has one child. Proposers,
the drafter API and the target's step all speak this type.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from specd.errors import InvalidArgument
from specd.v1 import drafter_pb2

ROOT = -1  # the parent index of a token that follows the sequence's last committed token


@dataclass(frozen=True)
class DraftTree:
    token_ids: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    # probs[i]: estimated chance the target accepts token i once its parent was accepted
    probs: tuple[float, ...] = ()
    score: float = 0.0  # the drafter's confidence in the whole draft; 0 = no opinion

    @classmethod
    def chain(cls, token_ids: list[int], probs: list[float] | None = None, score: float = 0.0) -> DraftTree:
        """Tokens one after another; without probs every token is estimated at 1."""
        return cls(tuple(token_ids), tuple(range(ROOT, len(token_ids) - 1)),
                   tuple(probs) if probs is not None else (1.0,) * len(token_ids), score)

    def __len__(self) -> int:
        return len(self.token_ids)

    @cached_property  # asked several times per sequence per step
    def is_chain(self) -> bool:
        return self.parents == tuple(range(ROOT, len(self.token_ids) - 1))

    def first_path(self) -> list[int]:
        """The tokens that follow each node's first child from the root: a chain's all, a best-first
        tree's likeliest path."""
        path, parent = [], ROOT
        for index, (token, node_parent) in enumerate(zip(self.token_ids, self.parents)):
            if node_parent == parent:
                path.append(token)
                parent = index
        return path

    def reaches(self) -> list[float]:
        """Each node's estimated chance that it and every ancestor are accepted: its probs multiplied
        down from the root (in a chain p_1, p_1·p_2, ...). Siblings exclude one another, so the sum is
        the tokens the draft is expected to yield."""
        out: list[float] = []
        for prob, parent in zip(self.probs, self.parents):
            out.append(prob * (out[parent] if parent != ROOT else 1.0))
        return out

    def matched(self, tokens: list[int]) -> int:
        """How many of `tokens` (what followed the draft's root) the tree holds as a path from the root: the
        draft tokens a greedy verification would have accepted."""
        node, count = ROOT, 0
        for token in tokens:
            node = next((child for child, (child_token, parent) in enumerate(zip(self.token_ids, self.parents))
                         if parent == node and child_token == token), None)
            if node is None:
                break
            count += 1
        return count

    def depths(self) -> list[int]:
        """Each node's depth: 1 for the root's children."""
        out: list[int] = []
        for parent in self.parents:
            out.append(1 + (out[parent] if parent != ROOT else 0))
        return out

    def paths(self) -> list[tuple[int, ...]]:
        """Each node's tokens from the root down to it."""
        out: list[tuple[int, ...]] = []
        for token, parent in zip(self.token_ids, self.parents):
            out.append((*(out[parent] if parent != ROOT else ()), token))
        return out

    def with_probs(self, probs: list[float]) -> DraftTree:
        return DraftTree(self.token_ids, self.parents, tuple(probs), self.score)

    def truncated(self, num_tokens: int) -> DraftTree:
        """The first num_tokens nodes: still a tree, because parents come before children."""
        if num_tokens >= len(self):
            return self
        return DraftTree(self.token_ids[:num_tokens], self.parents[:num_tokens], self.probs[:num_tokens], self.score)

    @classmethod
    def merge(cls, trees: list[DraftTree], max_nodes: int) -> tuple[DraftTree, list[dict[int, int]]]:
        """One tree of the trees' paths, a path several share once, best first and at most max_nodes; and
        for each input tree, its nodes' indices in the merged one (kept nodes only). A shared node takes the
        highest estimate any tree gives it; where siblings' estimates add up past 1 (trees sure of different
        continuations), they are scaled to sum to 1, since at most one of them can be accepted."""
        paths: dict[tuple[int, ...], float] = {}  # path of tokens -> estimate, parents first
        tree_paths: list[list[tuple[int, ...]]] = []
        for tree in trees:
            mine = tree.paths()
            for path, prob in zip(mine, tree.probs):
                paths[path] = max(paths.get(path, 0.0), prob)
            tree_paths.append(mine)
        siblings: dict[tuple[int, ...], float] = {}
        for path, prob in paths.items():
            siblings[path[:-1]] = siblings.get(path[:-1], 0.0) + prob
        probs = {path: prob / max(1.0, siblings[path[:-1]]) for path, prob in paths.items()}
        reach = {(): 1.0}
        for path, prob in probs.items():
            reach[path] = reach[path[:-1]] * prob
        order = sorted(probs, key=lambda path: (-reach[path], len(path)))[:max_nodes]  # a parent reaches as far
        index = {path: i for i, path in enumerate(order)}
        merged = cls(tuple(path[-1] for path in order), tuple(index.get(path[:-1], ROOT) for path in order),
                     tuple(probs[path] for path in order))
        return merged, [{i: index[path] for i, path in enumerate(mine) if path in index} for mine in tree_paths]

    def subtree(self, nodes: list[int]) -> DraftTree:
        """The tree of the given nodes (ascending, each one's parent among them), reindexed."""
        index = {node: i for i, node in enumerate(nodes)}
        return DraftTree(tuple(self.token_ids[n] for n in nodes),
                         tuple(index[self.parents[n]] if self.parents[n] != ROOT else ROOT for n in nodes),
                         tuple(self.probs[n] for n in nodes), self.score)

    def validate(self, field_prefix: str) -> None:
        if not len(self.parents) == len(self.probs) == len(self.token_ids):
            raise InvalidArgument(f"{field_prefix}.parent_ids",
                                  "token_ids, parent_ids and probs must have the same length")
        for i, parent in enumerate(self.parents):
            if not ROOT <= parent < i:
                raise InvalidArgument(f"{field_prefix}.parent_ids[{i}]",
                                      f"must be -1 or the index of an earlier token, got {parent}")
        if not all(0.0 <= p <= 1.0 for p in self.probs):
            raise InvalidArgument(f"{field_prefix}.probs", "must be probabilities in [0, 1]")

    def to_pb(self, sequence_id: str) -> drafter_pb2.Draft:
        return drafter_pb2.Draft(sequence_id=sequence_id, token_ids=self.token_ids, parent_ids=self.parents,
                                 probs=self.probs, score=self.score)

    @classmethod
    def from_pb(cls, pb: drafter_pb2.Draft) -> DraftTree:
        return cls(tuple(pb.token_ids), tuple(pb.parent_ids), tuple(pb.probs), pb.score)
