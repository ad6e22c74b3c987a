"""Suffix trees by corpus scope, their nodes counted together: a drafter that learns from outputs keeps
each scope's apart (what one tenant's requests teach drafts only that tenant's) under one bound."""
from __future__ import annotations

from collections.abc import Callable, Iterator

from drafter_svc.proposers.suffix_tree import SuffixTree


class ScopedTrees:
    def __init__(self, make: Callable[[], SuffixTree]):
        self._make = make  # a new scope's tree
        self._trees: dict[str, SuffixTree] = {}
        self.num_nodes = 0  # in all the trees

    def __len__(self) -> int:
        return len(self._trees)

    def get(self, scope: str) -> SuffixTree | None:
        """`scope`'s tree, None while it has none."""
        return self._trees.get(scope)

    def scopes(self) -> Iterator[str]:
        return iter(list(self._trees))

    def change(self, scope: str, change: Callable[[SuffixTree], object]) -> None:
        """`change` applied to `scope`'s tree (made where it has none), the node count kept; a tree left
        empty goes."""
        tree = self._trees.get(scope)
        if tree is None:
            tree = self._trees[scope] = self._make()
        before = tree.num_nodes
        change(tree)
        self.num_nodes += tree.num_nodes - before
        if tree.num_nodes == 0:
            del self._trees[scope]
