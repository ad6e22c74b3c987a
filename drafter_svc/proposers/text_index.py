"""One sequence's own text, searchable as a counting suffix tree (`suffix_tree.SuffixTree`) would be, for a
fraction of the cost of building one.

A sequence's tree is mostly its prompt: up to `depth` nodes a token (24 for `suffix`), ~60 us a token in
Python, so ~40 ms to take in a 600-token prompt, on the cores the target runs on, for every new sequence
a drafter is asked about. Most of those nodes are never visited: a draft starts from the few substrings
that end the sequence. So the text is kept as where each token occurs (an append a token), and the node of
a substring is found when asked: the places it ends, filtered from its last token's places one token back
at a time, its children the tokens that follow those places. Its counts are the tree's, so drafts are too.
"""
from __future__ import annotations

from drafter_svc.proposers.suffix_tree import counted


class TextIndex:
    """A text and where each of its tokens occurs; substrings of up to `depth` tokens are its nodes."""

    def __init__(self, depth: int, epoch: int = 0):
        self.depth = depth
        self.epoch = epoch  # of the SequenceState tokens it holds
        self.tokens: list[int] = []
        self._places: dict[int, list[int]] = {}  # token -> its positions, ascending

    def sync(self, tokens: list[int]) -> None:
        """Take in the tokens of `tokens` past those held (the same text, grown)."""
        places = self._places
        for position in range(len(self.tokens), len(tokens)):
            token = tokens[position]
            found = places.get(token)
            if found is None:
                places[token] = [position]
            else:
                found.append(position)
        self.tokens.extend(tokens[len(self.tokens):])

    def node(self, substring: list[int]) -> TextNode | None:
        """The node `substring` ends at, if the text holds it with a token after it."""
        if not substring or len(substring) > self.depth:
            return None
        ends = self._places.get(substring[-1])
        for back in range(1, len(substring)):
            if not ends:
                return None
            ends = self._narrowed(ends, back, substring[-1 - back])
        return TextNode(self, ends, len(substring)) if self._continued(ends) else None

    def matches(self, context: list[int], longest: int) -> list[tuple[int, TextNode]]:
        """(n, node) for each n up to `longest` whose last-n-token substring of `context` occurs with a token
        after it (nothing can be drafted from the others), shortest first; a substring of one that does, does too."""
        found = []
        ends = self._places.get(context[-1]) if context else None
        for n in range(1, min(longest, self.depth, len(context)) + 1):
            if n > 1:
                ends = self._narrowed(ends, n - 1, context[-n])
            if not self._continued(ends):
                break
            found.append((n, TextNode(self, ends, n)))
        return found

    def _narrowed(self, ends: list[int], back: int, token: int) -> list[int]:
        """The places of `ends` that have `token` `back` tokens before them."""
        tokens = self.tokens
        return [end for end in ends if end >= back and tokens[end - back] == token]

    def _continued(self, ends: list[int] | None) -> bool:
        """Whether a token follows any of `ends` (ascending): all but the text's last place have one."""
        return bool(ends) and ends[0] < len(self.tokens) - 1


class TextNode:
    """A substring of a `TextIndex`'s text: `count` occurrences (ending at `ends`) and, as a suffix tree node,
    the children that follow them, worked out when first asked."""
    __slots__ = ("_index", "ends", "count", "length", "_children")

    def __init__(self, index: TextIndex, ends: list[int], length: int):
        self._index = index
        self.ends = ends
        self.count = len(ends)
        self.length = length
        self._children: dict[int, TextNode] | None = None

    @property
    def children(self) -> dict[int, TextNode]:
        if self._children is None:
            grouped: dict[int, list[int]] = {}
            tokens = self._index.tokens
            if self.length < self._index.depth:
                last = len(tokens) - 1
                for end in self.ends:
                    if end < last:
                        grouped.setdefault(tokens[end + 1], []).append(end + 1)
            self._children = {token: TextNode(self._index, ends, self.length + 1) for token, ends in grouped.items()}
        return self._children

    def continuations(self, min_share: float) -> tuple[int, list[tuple[int, TextNode]]]:
        return counted(self.children)
