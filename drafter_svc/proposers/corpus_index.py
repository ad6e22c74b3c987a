"""A warm corpus (drafter_svc.warm_corpus), searchable as a counting suffix tree (`suffix_tree.SuffixTree`)
would be, at a few bytes a token instead of ~24 nodes of ~0.3 KB.

The corpus never changes once served, so it is kept as one array of its texts, each ended by END, and a
suffix array: every start position, sorted by the tokens from there on. The occurrences of a substring are
then one run of that order, found by binary search; its count is the run's length, and its children are
the runs within it that share the next token (sorted too, so each child is found by binary search as well).
Nodes are worked out when asked, so a lookup costs a few dozen comparisons, not a walk over a prebuilt tree.
"""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right

import numpy as np

from drafter_svc.proposers.suffix_tree import suffix_matches

END = -1  # after each text: never a token, sorts before all, so no substring found runs across texts


class CorpusIndex:
    """Texts, and every substring of up to `depth` tokens as a node: its occurrences and what follows them."""

    def __init__(self, texts: list[list[int]], depth: int):
        self.depth = depth
        joined = [token for text in texts if text for token in (*text, END)]
        self.num_tokens = len(joined) - sum(1 for text in texts if text)
        self.text = joined
        self.order = _suffix_order(np.array(joined, dtype=np.int64), depth + 1).tolist()
        self.root = CorpusNode(self, 0, len(joined), 0)

    def node(self, substring: list[int]) -> CorpusNode | None:
        """The node `substring` ends at, if the corpus holds it."""
        if not substring or len(substring) > self.depth:
            return None
        text, n = self.text, len(substring)
        key = lambda start: text[start:start + n]  # noqa: E731: the suffix's first n tokens, as bisect compares them
        lo = bisect_left(self.order, substring, key=key)
        hi = bisect_right(self.order, substring, lo, key=key)
        return CorpusNode(self, lo, hi, n) if hi > lo else None

    def matches(self, tokens: list[int], longest: int) -> list[tuple[int, CorpusNode]]:
        return suffix_matches(self.node, tokens, min(longest, self.depth))


class CorpusNode:
    """A substring of the corpus: the run `lo`..`hi` of its suffix order that starts with it (`length` tokens)."""
    __slots__ = ("_index", "lo", "hi", "length")

    def __init__(self, index: CorpusIndex, lo: int, hi: int, length: int):
        self._index, self.lo, self.hi, self.length = index, lo, hi, length

    @property
    def count(self) -> int:
        return self.hi - self.lo

    def continuations(self, min_share: float) -> tuple[int, list[tuple[int, CorpusNode]]]:
        """How often a token follows the substring, and each token that does at least `min_share` of those
        times, with its node, in token order. A run that long holds one of every `least` places from where the
        tokens start, so only those places are looked at: a few, not every occurrence of a common substring."""
        index = self._index
        if self.length >= index.depth:
            return 0, []
        text, order, at = index.text, index.order, self.length
        key = lambda start: text[start + at]  # noqa: E731: the token after the substring
        first = bisect_right(order, END, self.lo, self.hi, key=key)  # the occurrences that end a text go first
        total = self.hi - first
        least = max(1, math.ceil(min_share * total * (1 - 1e-9)))  # a share at the bound is in
        found, place = [], first
        while place < self.hi:
            token = key(order[place])
            start = bisect_left(order, token, first, place, key=key)
            end = bisect_right(order, token, place, self.hi, key=key)
            if end - start >= least:
                found.append((token, CorpusNode(index, start, end, at + 1)))
            place = max(end, place + least)
        return total, found


def _suffix_order(text: np.ndarray, length: int) -> np.ndarray:
    """Every start position of `text`, sorted by the (up to) `length` tokens from there on, by prefix doubling:
    suffixes ranked by their first k tokens are ranked by their first 2k as pairs of ranks, k and k further on."""
    size = len(text)
    rank = text + 1  # END (-1) first
    order = np.argsort(rank, kind="stable")
    span = 1
    while span < length:
        later = np.full(size, -1, dtype=np.int64)  # past the end: before everything
        later[:max(size - span, 0)] = rank[span:]
        order = np.lexsort((later, rank))
        changed = (np.diff(rank[order]) != 0) | (np.diff(later[order]) != 0)
        rank = np.empty(size, dtype=np.int64)
        rank[order] = np.concatenate(([0], np.cumsum(changed)))
        span *= 2
    return order
