"""`method: auto`: the target picks, for each sequence and step, which of the deployment's drafters to
ask (`fused` among them: all of them at once), by what each has gained so far, less what waiting for
its answer costs (an explore/exploit rule over its drafts' gain).

A text's best drafter is a property of the text (code repeats its prompt: n-gram; a chat that echoes
earlier answers: suffix or trie), so each sequence learns its own choice, starting from what each drafter
has gained the deployment's sequences when asked at set times (`MethodRecord`): the one expected to gain the
most (its accepted draft tokens, less what verifying them cost the batch, less the tokens its round trip is
worth: `fused` waits for the slowest of several drafters, measured 2-2.6 ms against ~1 ms for one, on a 12 ms
step at batch 1) is asked. What a drafter is expected to gain a sequence is the sequence's own recent asks
of it, with the record counted as PRIOR_ASKS more (`_expected`): gains come in runs, and a plain moving mean
of the sequence's asks alone, weighing the newest a quarter, fell below zero within a few empty asks and
handed the sequence to a drafter that offered nothing (lookahead, whose window does not pay at batch 1 on a
CPU: a fifth of the asks of Spec-Bench's sequences went to it). The sequence's asks count for up to ~20
(MEMORY): counting for ~5 beside the record's 2, a record that had come out high on a few asks kept
sequences on a drafter their own asks showed gained them nothing, in one run of two alike. Every
EXPLORE_EVERY asks the one asked longest ago, so a drafter that starts to pay later (a text turning
repetitive) is found. A drafter the deployment has no record of yet is tried TRIALS times first. The
drafters' own gates still decide whether a step asks at all.
"""
from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from specd.options import OptionSchema
from specd.types import AUTO_METHOD
from target_svc.drafting.means import warmed

AUTO_SCHEMA = OptionSchema(AUTO_METHOD)  # no options: each drafter runs on its deployment defaults
TRIALS = 2
EXPLORE_EVERY = 8
PRIOR_ASKS = 2.0  # the asks the deployment's record of a drafter counts as, beside a sequence's own
MEMORY = 0.95  # the weight a sequence's earlier asks of a drafter keep at each new one: its last ~20 count
RECORD_SMOOTHING = 1 / 64  # weight of a drafter's newest ask in the deployment's record


class MethodRecord:
    """What an ask of each drafter has gained any `auto` sequence of the deployment, a moving mean: where a
    new sequence's choice starts. Only trials and explorations count: they ask a drafter at times set by the
    count of asks, whatever it has been gaining, while a "best" ask comes when the drafter was paying that
    sequence, and counting those lifted the record of whichever drafters had runs (measured per ask over 13
    Spec-Bench prompts: `trie`'s record 0.78 tokens, `suffix`'s 0.34, though `suffix` alone was the faster)."""

    def __init__(self):
        self.gain: dict[str, float] = {}
        self.asks: dict[str, int] = {}

    def observe(self, method: str, gain: float) -> None:
        """Warmed (`means.warmed`): moving from its first ask alone, the record kept a drafter's one try on
        the deployment's first sequence, whose caches were empty, for dozens of asks."""
        asks = self.asks[method] = self.asks.get(method, 0) + 1
        self.gain[method] = warmed(self.gain.get(method), gain, asks, RECORD_SMOOTHING)


class MethodChooser:
    """One auto sequence's choice among `methods`."""

    def __init__(self, methods: list[str], record: MethodRecord | None = None):
        self._methods = list(methods)
        self._record = record if record is not None else MethodRecord()
        # Per method this sequence asked: its gains and its asks, the earlier ones weighing MEMORY less at each ask.
        self._gains: dict[str, float] = {}
        self._weights: dict[str, float] = {}
        self._last_asked = {method: -1 for method in methods}
        self._total_asks = 0
        self.current = self._methods[0]  # the latest choice
        self._why = "trial"  # and why it was made

    def choose(self, round_trip_cost: Mapping[str, float] = MappingProxyType({})) -> tuple[str, str]:
        """The method to ask this step, and why: "trial", "explore" or "best". `round_trip_cost`: by method,
        the tokens an ask's round trip is worth to one sequence (the share of a step the batch waits)."""
        self.current, self._why = self._choice(round_trip_cost)
        return self.current, self._why

    def _choice(self, round_trip_cost: Mapping[str, float]) -> tuple[str, str]:
        untried = [m for m in self._methods if self._record.asks.get(m, 0) < TRIALS]
        if untried:
            return min(untried, key=lambda m: (self._record.asks.get(m, 0), self._methods.index(m))), "trial"
        if len(self._methods) > 1 and self._total_asks % EXPLORE_EVERY == EXPLORE_EVERY - 1:
            return min(self._methods, key=lambda m: self._last_asked[m]), "explore"
        return max(self._methods, key=lambda m: (self._expected(m) - round_trip_cost.get(m, 0.0),
                                                 -self._methods.index(m))), "best"

    def _expected(self, method: str) -> float:
        """What an ask of `method` is expected to gain: the sequence's recent asks of it and the deployment's
        record, which counts as PRIOR_ASKS asks."""
        return ((PRIOR_ASKS * self._record.gain[method] + self._gains.get(method, 0.0))
                / (PRIOR_ASKS + self._weights.get(method, 0.0)))

    def observe(self, method: str, gain: float) -> None:
        """An ask of `method` (the latest choice) gained the batch `gain` tokens (0 for no draft)."""
        self._gains[method] = MEMORY * self._gains.get(method, 0.0) + gain
        self._weights[method] = MEMORY * self._weights.get(method, 0.0) + 1.0
        if self._why != "best":
            self._record.observe(method, gain)
        self._last_asked[method] = self._total_asks
        self._total_asks += 1
