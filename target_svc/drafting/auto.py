"""`method: auto`: the target picks, for each sequence and step, which of the deployment's drafters to
ask, by what each has gained that sequence so far (an explore/exploit rule over its drafts' gain).

A text's best drafter is a property of the text (code repeats its prompt: n-gram; a chat that echoes
earlier answers: suffix or trie), so each sequence learns its own choice: every drafter is tried
TRIALS times first, in turn; then the one whose asks have gained the most (a moving mean of its
accepted draft tokens, less what verifying them cost the batch) is asked, and every EXPLORE_EVERY asks
the one asked longest ago, so a drafter that starts to pay later (a text turning repetitive) is found.
The drafters' own gates still decide whether a step asks at all.
"""
from __future__ import annotations

from specd.options import OptionSchema

AUTO_METHOD = "auto"
AUTO_SCHEMA = OptionSchema(AUTO_METHOD)  # no options: each drafter runs on its deployment defaults
TRIALS = 2
EXPLORE_EVERY = 8
SMOOTHING = 0.25  # weight of a drafter's newest ask in its mean gain


class MethodChooser:
    """One auto sequence's choice among `methods`."""

    def __init__(self, methods: list[str]):
        self._methods = list(methods)
        self._gain: dict[str, float] = {}  # a moving mean per method, once asked
        self._asks = {method: 0 for method in methods}
        self._last_asked = {method: -1 for method in methods}
        self._total_asks = 0
        self.current = self._methods[0]  # the latest choice

    def choose(self) -> tuple[str, str]:
        """The method to ask this step, and why: "trial", "explore" or "best"."""
        self.current, why = self._choice()
        return self.current, why

    def _choice(self) -> tuple[str, str]:
        untried = [m for m in self._methods if self._asks[m] < TRIALS]
        if untried:
            return min(untried, key=lambda m: (self._asks[m], self._methods.index(m))), "trial"
        if len(self._methods) > 1 and self._total_asks % EXPLORE_EVERY == EXPLORE_EVERY - 1:
            return min(self._methods, key=lambda m: self._last_asked[m]), "explore"
        return max(self._methods, key=lambda m: (self._gain[m], -self._methods.index(m))), "best"

    def observe(self, method: str, gain: float) -> None:
        """An ask of `method` gained the batch `gain` tokens (0 for no draft)."""
        mean = self._gain.get(method)
        self._gain[method] = gain if mean is None else mean + SMOOTHING * (gain - mean)
        self._asks[method] += 1
        self._last_asked[method] = self._total_asks
        self._total_asks += 1
