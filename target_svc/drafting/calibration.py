"""How far each drafter's acceptance estimates come true, depth by depth, to correct them before they
price drafts.

A drafter estimates each draft token's chance of acceptance, and the target keeps the draft tokens
whose expected yield pays for them (`choose_drafts`); estimates that run high keep tokens that do not
pay, and estimates that run low cut drafts short of what would. How far they are off depends on the
depth: measured on 13 Spec-Bench prompts (bf16, the drafts of `fused`'s members at the same steps),
`trie`'s reaches came true 52% at depth 1 and 15% at depth 8, while `ngram`'s came true 100% at depth 1
and 136% at depth 8. So the target compares, per method and depth, the tokens its verified drafts were
expected to yield there (the sum of their reaches at that depth: `DraftTree.reaches`, siblings exclude
one another) with how often the accepted path reached that depth, over about RECENT_DRAFTS drafts, and
scales the method's next reaches at each depth by that ratio. A source that tells its drafts' nodes apart
(`fused`: a member's nodes another member also proposed, and those it proposed alone) tallies each kind
under a key of its own (`observe_nodes`, `corrected_nodes`).
"""
from __future__ import annotations

from collections.abc import Iterable

from specd.drafts import ROOT, DraftTree

RECENT_DRAFTS = 256
# Pseudo-evidence, worth this many tokens at each depth, that a depth's reaches come true as far as its
# parent depth's do: a few early misses move a factor a little, never to zero (a method whose estimates
# were scaled to nothing would never be verified again, and so never be seen to recover), and a depth
# rarely verified keeps its parent's factor.
PRIOR_TOKENS = 8.0
# Depths past this are tallied with it (few drafts reach them), and a node there keeps its drafter's own
# chance once its ancestor at this depth is scaled.
MAX_DEPTH = 16


class _DepthTally:
    """One method's decaying sums per depth: the reaches its verified drafts put there, and how often
    their accepted path reached it."""

    def __init__(self):
        self.expected = [0.0] * MAX_DEPTH
        self.accepted = [0.0] * MAX_DEPTH
        # The factors as of the latest add: every draft of every step is corrected by them (`fused`: each
        # member's two records, per sequence), and they change only when a verified draft is tallied.
        self._factors: list[float] | None = None

    def add(self, reaches: list[tuple[float, int]], accepted_depths: Iterable[int]) -> None:
        """One verified draft's (reach, depth) of each node tallied, and the depths its accepted path reached
        through them."""
        keep = 1.0 - 1.0 / RECENT_DRAFTS
        self.expected = [e * keep for e in self.expected]
        self.accepted = [a * keep for a in self.accepted]
        for reach, depth in reaches:
            self.expected[min(depth, MAX_DEPTH) - 1] += reach
        for depth in accepted_depths:
            self.accepted[min(depth, MAX_DEPTH) - 1] += 1.0
        self._factors = None

    def factors(self) -> list[float]:
        """By depth (1 first), accepted over expected, drawn to the parent depth's factor (1 above the root)
        by PRIOR_TOKENS."""
        if self._factors is None:
            self._factors, parent = [], 1.0
            for expected, accepted in zip(self.expected, self.accepted):
                parent = (accepted + PRIOR_TOKENS * parent) / (expected + PRIOR_TOKENS)
                self._factors.append(parent)
        return self._factors


class AcceptanceCalibration:
    def __init__(self):
        self._tallies: dict[str, _DepthTally] = {}

    def observe(self, method: str, draft: DraftTree, accepted: int) -> None:
        """A verified draft, its estimates as the drafter sent them, and how many of its tokens were accepted."""
        self._tallies.setdefault(method, _DepthTally()).add(list(zip(draft.reaches(), draft.depths())),
                                                            range(1, accepted + 1))

    def observe_nodes(self, key: str, draft: DraftTree, nodes: list[int], accepted_nodes: list[int]) -> None:
        """Of a verified draft (its estimates as sent), the `nodes` tallied under `key`, and those of them
        on the accepted path."""
        reaches, depths = draft.reaches(), draft.depths()
        self._tallies.setdefault(key, _DepthTally()).add([(reaches[n], depths[n]) for n in nodes],
                                                         [depths[n] for n in accepted_nodes])

    def factors(self, method: str) -> list[float]:
        """By depth (1 first, MAX_DEPTH last, for every depth from there on): what the method's reaches there
        are scaled by."""
        tally = self._tallies.get(method)
        return tally.factors() if tally is not None else [1.0] * MAX_DEPTH

    def corrected(self, method: str, draft: DraftTree) -> DraftTree:
        """`draft` with each node's reach scaled by its depth's factor: each token's estimate by its depth's
        factor over its parent's, and siblings' estimates scaled down together where they sum past 1 (at most
        one of them can be accepted; an only child's estimate is at most 1)."""
        if method not in self._tallies or not draft:
            return draft
        return self.corrected_nodes([method] * len(draft), draft)

    def corrected_nodes(self, keys: list[str], draft: DraftTree) -> DraftTree:
        """As `corrected`, each node's reach scaled by the factor of its own key (`keys[node]`) at its depth."""
        factors = {key: [1.0, *self.factors(key)] for key in set(keys)}
        depths = draft.depths()
        probs = [prob * factors[key][min(depth, MAX_DEPTH)]
                 / (factors[keys[parent]][min(depth - 1, MAX_DEPTH)] if parent != ROOT else 1.0)
                 for prob, depth, key, parent in zip(draft.probs, depths, keys, draft.parents)]
        siblings: dict[int, float] = {}
        for prob, parent in zip(probs, draft.parents):
            siblings[parent] = siblings.get(parent, 0.0) + prob
        return draft.with_probs([prob / max(1.0, siblings[parent]) for prob, parent in zip(probs, draft.parents)])
