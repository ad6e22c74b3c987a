"""`method: auto`: the target picks, for each sequence and step, which of the deployment's drafters to
ask (`fused` among them: `Drafters.auto_methods`), by what each has gained so far, less what waiting for
its answer costs (an explore/exploit rule over its drafts' gain).

A text's best drafter is a property of the text (code repeats its prompt: n-gram; a chat that echoes
earlier answers: suffix or trie), so each sequence learns its own choice, starting from what each drafter
has gained the deployment's sequences when asked at set times (`MethodRecord`): the one expected to gain the
most (its accepted draft tokens, less what verifying them cost the batch, less the tokens its round trip is
worth: a drafter service's ~1 ms on a 12 ms step at batch 1, a draft model's several; the time priced at
the tokens the deployment makes of it, `_worth`) is asked. What a
drafter is expected to gain a sequence is the sequence's own recent asks of it at shadow steps (below),
where every drafter is asked and so compared at the same steps of the text, with the record counted as
PRIOR_ASKS more (`_expected`): gains come in runs, and a plain moving mean of the sequence's asks alone,
weighing the newest a quarter, fell below zero within a few empty asks and handed the sequence to a drafter
that offered nothing (lookahead, whose window does not pay at batch 1 on a CPU: a fifth of the asks of
Spec-Bench's sequences went to it). The sequence's asks count for up to ~20
(MEMORY), the record for 8: scored at shadow steps (below), it compares the drafters at the same steps of
every sequence, and at 2 the sequences' few noisy asks moved them among drafters of about the same worth.

Every SHADOW_EVERY steps of the deployment, the other drafters are asked beside the chosen one, and their
drafts, never verified, are scored against the tokens the sequence goes on to produce (`ShadowDraft`: the
path a greedy verification would have accepted, less what verifying the draft would have cost). A drafter is
thus compared with the others at the same steps of the same text, and the deployment's record learns from
every drafter at once, for the price of a concurrent round trip. The steps are the deployment's, not each
sequence's: a step that asks every drafter waits for the slowest, and their work takes the target's cores,
so every sequence's shadow asks go in the same steps (counted by each sequence's own asks, at 32 clients
some sequence had a shadow ask in nearly every step). (Exploring instead by a verified ask of the drafter asked
longest ago, every 8th ask went to a drafter that mostly paid less, and the record heard from each drafter
once in ~40 asks: on a fresh stack its first prompts' asks went to drafters that had come out well in two
trials, and `auto` drafted a fifth of what `suffix` did on them; 0.935x `suffix` overall. Every 32nd ask, it
settled on `ngram` for two thirds of its asks, 0.94x.) Lookahead is shadowed by the draft of its n-gram pool,
which the target makes itself; what its window would add is not scored, since the window runs only in the
forward of the sequences that chose it (explored instead by a verified ask every 32nd ask, lookahead took ~3%
of the asks of Spec-Bench's sequences, mostly where `suffix` would have drafted further). The window's
price is charged, though, wherever it would have run (`Scheduler._price_shadows`): scored as its pool's draft
alone, lookahead won 6% of the "best" asks on Spec-Bench (fp32, batch 1, 2-core EPYC), whose steps, with
their windows, made 46 tokens a second against 71 for those asking `suffix`.
Once a sequence has chosen, it stays with its drafter until another is expected to gain SWITCH_MARGIN
tokens an ask more: without it, drafters of about the same worth took turns on noise (on 13 Spec-Bench
prompts `ngram` took a sixth of the "best" asks though `suffix` alone was faster in every category), and
each turn to the lesser one was paid for in verified asks. A drafter the deployment has no record of yet is
tried TRIALS times first. The drafters' own gates still decide whether a step asks at all, going by the
chooser's estimate; an ask a gate makes after passing the sequence over compares the drafters too (`compare`).

Scoring by the greedy path is exact for greedy requests; for sampled ones it estimates (a drafted token
the sampler did not pick could still have been accepted).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from specd.drafts import DraftTree
from specd.options import OptionSchema
from specd.types import AUTO_METHOD
from target_svc.drafting.means import warmed

AUTO_SCHEMA = OptionSchema(AUTO_METHOD)  # no options: each drafter runs on its deployment defaults
TRIALS = 2
SHADOW_EVERY = 8  # steps between those that ask the other drafters alongside
PRIOR_ASKS = 8.0  # the asks the deployment's record of a drafter counts as, beside a sequence's own
MEMORY = 0.95  # the weight a sequence's earlier asks of a drafter keep at each new one: its last ~20 count
# A sequence leaves its drafter only for one expected to gain this many more tokens an ask: estimates of
# about the same worth cross back and forth on noise, and each move to a drafter that gains less is paid
# for in verified asks until its estimate falls back.
SWITCH_MARGIN = 0.15
RECORD_SMOOTHING = 1 / 64  # weight of a drafter's newest ask in the deployment's record
# Asks of one drafter the record counts in one step, at most: a shadow step's sequences are scored at the
# same point of their texts, and at ~50 of them, each moving the record by RECORD_SMOOTHING, that one moment
# made most of it (`MethodRecord.observe`).
RECORD_ASKS_A_STEP = 8


class MethodRecord:
    """What an ask of each drafter has gained any `auto` sequence of the deployment, a moving mean: where a
    new sequence's choice starts. Only asks at times set by the count of asks count (trials, and every
    drafter at a shadow step), whatever the drafter has been gaining; a "best" ask comes when the
    drafter was paying that sequence, and counting those lifted the record of whichever drafters had runs
    (measured per ask over 13 Spec-Bench prompts: `trie`'s record 0.78 tokens, `suffix`'s 0.34, though
    `suffix` alone was the faster)."""

    def __init__(self):
        self.gain: dict[str, float] = {}
        self.price: dict[str, float] = {}  # of which, what verifying its drafts cost the batch (decode tokens)
        self.asks: dict[str, int] = {}
        self.steps = 0  # the deployment's steps so far: every SHADOW_EVERY-th is a shadow step
        self._counted: dict[str, int] = {}  # asks of each drafter counted this step

    def new_step(self) -> None:
        self.steps += 1
        self._counted = {}

    @property
    def shadow_step(self) -> bool:
        """Whether this step asks the other drafters beside each sequence's choice."""
        return self.steps % SHADOW_EVERY == 0

    def observe(self, method: str, gain: float, price: float = 0.0) -> None:
        """An ask of `method` gained `gain` tokens net of `price`, what verifying its draft cost. Warmed
        (`means.warmed`): moving from its first ask alone, the record kept a drafter's one try on the
        deployment's first sequence, whose caches were empty, for dozens of asks. Past RECORD_ASKS_A_STEP
        asks of the drafter in this step, an ask is not counted: counted all, on a fresh stack at 64 clients
        (fp32, 2-core Xeon) each shadow step remade the record from ~50 sequences that had just started, and
        the batch's drafter went through five drafters in ~60 steps, 16 of them asking lookahead, whose pools
        were still empty, for nothing (that first round 0.87x `none`; 1.17x and 1.05x in two runs counting 8)."""
        counted = self._counted[method] = self._counted.get(method, 0) + 1
        if counted > RECORD_ASKS_A_STEP:
            return
        asks = self.asks[method] = self.asks.get(method, 0) + 1
        self.gain[method] = warmed(self.gain.get(method), gain, asks, RECORD_SMOOTHING)
        self.price[method] = warmed(self.price.get(method), price, asks, RECORD_SMOOTHING)


@dataclass(frozen=True)
class ShadowDraft:
    """A draft asked for beside the chosen drafter's and not verified: `draft` as far as the target would
    have verified it, proposed after the sequence's first `anchor` tokens, and `price`, the decode tokens
    verifying it would have cost the batch."""
    method: str
    anchor: int
    draft: DraftTree
    price: float

    def gain(self, tokens: list[int], finished: bool) -> float | None:
        """What it would have gained, net of its price, once the sequence's `tokens` are known as deep as the
        draft reaches (or the sequence finished); None before."""
        followed = tokens[self.anchor:]
        if not finished and len(followed) < max(self.draft.depths(), default=0):
            return None
        return self.draft.matched(followed) - self.price


class MethodChooser:
    """One auto sequence's choice among `methods`."""

    def __init__(self, methods: list[str], record: MethodRecord | None = None):
        self._methods = list(methods)
        self.record = record if record is not None else MethodRecord()  # the deployment's, shared
        # Per method this sequence asked: its gains, their prices and its asks, the earlier ones weighing MEMORY
        # less at each ask.
        self._gains: dict[str, float] = {}
        self._prices: dict[str, float] = {}
        self._weights: dict[str, float] = {}
        self._pending: list[ShadowDraft] = []
        self.current = self._methods[0]  # the latest choice
        self._why = "trial"  # and why it was made
        self.shadows: list[str] = []  # the drafters to ask beside it, their drafts to be scored, not verified

    def choose(self, round_trip_cost: Mapping[str, float] = MappingProxyType({}),
               speedup: float = 1.0) -> tuple[str, str]:
        """The method to ask this step, and why: "trial" or "best" (with `shadows` set). `round_trip_cost`:
        by method, the tokens an ask's round trip is worth to one sequence (the share of a plain decoding step
        the batch waits); `speedup`: the deployment's tokens per second over plain decoding's (`_worth`)."""
        self.current, self._why = self._choice(round_trip_cost, speedup)
        shadow_step = self._why == "best" and self.record.shadow_step
        self.shadows = self._others() if shadow_step else []
        return self.current, self._why

    def compare(self) -> None:
        """This step asks the sequence's choice though the gate had passed it over (a probe): the other
        drafters are asked beside it, as at a shadow step. The gate goes by this chooser's estimate, which
        moves at such steps alone; without them a sequence the gate had left unasked kept the estimate that
        had it left unasked (on a Spec-Bench writing prompt, 128 of 182 steps went unasked, 0.87x `fused`
        alone, whose drafts paid there)."""
        if self._why != "trial":
            self.shadows = self._others()

    def follow(self, method: str) -> None:
        """This step asks `method` for the sequence instead of its "best" choice (the drafter most of the
        batch chose: `Drafters.choose_methods`); what the ask gains counts for `method`."""
        self.current = method
        if self.shadows:
            self.shadows = self._others()

    def _others(self) -> list[str]:
        """The drafters besides the current choice: those a comparison asks beside it."""
        return [m for m in self._methods if m != self.current]

    def _choice(self, round_trip_cost: Mapping[str, float], speedup: float) -> tuple[str, str]:
        untried = [m for m in self._methods if self.record.asks.get(m, 0) < TRIALS]
        if untried:
            return min(untried, key=lambda m: (self.record.asks.get(m, 0), self._methods.index(m))), "trial"
        worth = {m: self._worth(m, round_trip_cost.get(m, 0.0), speedup) for m in self._methods}
        best = max(self._methods, key=lambda m: (worth[m], -self._methods.index(m)))
        # A trial (or no ask yet) is not a choice to stay with; a "best" one, or the batch's drafter it followed, is,
        # while asking it is worth its round trip or no drafter's is (else the gate leaves the sequence unasked).
        staying = worth[self.current] > 0 or worth[best] <= 0
        if self._why != "trial" and staying and worth[best] < worth[self.current] + SWITCH_MARGIN:
            return self.current, "best"
        return best, "best"

    def expected_gain(self) -> float | None:
        """What an ask of the current choice is expected to gain: what the gate weighs against its round
        trip, so that the two judge a drafter alike (None while it is on trial)."""
        return None if self._why == "trial" else self._expected(self.current)

    def _worth(self, method: str, round_trip_cost: float, speedup: float) -> float:
        """What asking `method` rather than no drafter is worth, in tokens, where time buys `speedup` times the
        tokens plain decoding makes of it. Gains and round trips are priced in plain decoding's tokens, which is
        right for whether to ask at all (the gate's question: the alternative is a plain step). Between two
        drafters that both ask, the time one costs more is worth what the deployment makes of time now:
        priced at plain decoding's rate, at batch 1 (~2x `none`) a drafter whose larger drafts gained a
        tenth of a token more an ask looked the better though its steps were ~8% longer (`fused` beside
        `suffix` on Spec-Bench's writing prompts)."""
        surcharge = speedup - 1.0
        return (self._expected(method) - surcharge * self._estimate(method, self.record.price, self._prices)
                - speedup * round_trip_cost)

    def _expected(self, method: str) -> float:
        """What an ask of `method` is expected to gain (`_estimate`)."""
        return self._estimate(method, self.record.gain, self._gains)

    def _estimate(self, method: str, record: Mapping[str, float], own: Mapping[str, float]) -> float:
        """The sequence's recent asks of `method` (`own`: their weighted sum) and the deployment's `record`,
        which counts as the asks it holds, up to PRIOR_ASKS (a drafter the record has few asks of stands on
        them: lifted by a lucky trial and counted as 8, the record kept sequences on `lookahead` for a sixth
        of their asks)."""
        prior = min(PRIOR_ASKS, self.record.asks[method])
        return (prior * record[method] + own.get(method, 0.0)) / (prior + self._weights.get(method, 0.0))

    def observe(self, method: str, gain: float, price: float = 0.0) -> None:
        """An ask of `method` (the latest choice) gained the batch `gain` tokens (0 for no draft), net of
        `price`, the decode tokens verifying its draft cost. It counts only where the other drafters were
        asked beside it (a shadow step), or on trial: drafters are compared at the same steps of the text.
        (Counted at every step, the chosen drafter's estimate followed each dry spell of the text at once
        while the others' moved at their shadow steps alone, so a sequence left the drafter a dry spell found
        it on, for another just as dry: on a Spec-Bench reasoning prompt `auto` went from `fused` to `suffix`
        at such a spell 42 steps in and stayed, and took 115 steps where `fused` alone took 105.)"""
        if self._why != "best" or self.shadows:
            self._count(method, gain, price)

    def shadowed(self, shadow: ShadowDraft) -> None:
        """A drafter asked beside the chosen one drafted `shadow` (an empty draft where it had none)."""
        self._pending.append(shadow)

    def settle(self, tokens: list[int], finished: bool) -> None:
        """The sequence's tokens so far: the shadow drafts they reach past are scored."""
        waiting = []
        for shadow in self._pending:
            gain = shadow.gain(tokens, finished)
            if gain is None:
                waiting.append(shadow)
            else:
                self._count(shadow.method, gain, shadow.price)
        self._pending = waiting

    def _count(self, method: str, gain: float, price: float) -> None:
        self._gains[method] = MEMORY * self._gains.get(method, 0.0) + gain
        self._prices[method] = MEMORY * self._prices.get(method, 0.0) + price
        self._weights[method] = MEMORY * self._weights.get(method, 0.0) + 1.0
        self.record.observe(method, gain, price)
