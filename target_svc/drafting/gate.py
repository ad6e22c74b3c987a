"""Whether a step asks a drafter at all: its round trip against what its drafts have been gaining (each
drafter has its own gate).

While the drafters answer, the model waits; the step cost model does not see that time, and with one
sequence it is about a tenth of a step. So each sequence keeps a moving mean of what an ask gained it
(`Sequence.draft_gain`): the draft tokens accepted, less the decode tokens that verifying its draft
cost the batch (`Scheduled.draft_price`); an ask that offered it nothing gained nothing, because its
round trip was paid all the same. A step asks only when the gain the batch expects is worth more than
the tokens the batch would decode in the round trip, decoding plainly (the cost model's price of the
decodes' newest tokens alone, and what every step costs besides its forward: prompt chunks riding in
the steps are done whatever is asked, and counted in, they made a round trip look cheap under load).

What a sequence is expected to gain is its own mean, drifting back to what asks have typically gained
any sequence (`typical_gain`) while it goes unasked: its text may have turned repetitive since. A
sequence never asked is expected to gain the typical. So a batch of sequences whose drafts do not pay
is asked rarely, one whole batch at a time, and never for a single newcomer's sake; and a step asks
anyway when none has for PROBE_EVERY steps, so that the typical gain itself stays current, or for as
many steps as keep the probes' round trips to PROBE_SHARE of the time, if more: a drafter whose round
trip is several steps long (a draft model on the target's cores) would otherwise cost a third of the
speed in probes alone (measured: a LayerSkip draft model that never gained, at batch 1, 0.67x `none`).
Where a step's sequences want several drafters (`auto`), their gates share that share: each probing on
its own, five of them asked a third of the steps at 32 clients for drafts that did not pay.
The spacing goes by the drafter's typical round trip, not its fastest: a model drafter's probe catches its
cache up on every token since the last one (45 ms a probe on average, a few at its fastest). Spaced by its
fastest to 5% of the time, the probes cost that LayerSkip draft model 27% of the speed on Spec-Bench at
batch 1 (0.73x `none`); by its typical round trip to 2%, 4% (0.96x). Until asks have gained
TYPICAL_EVIDENCE sequences anything, every step asks: a text's first repeat comes a few steps in, and a
first empty answer says little about what asks gain.

Where the step asks some drafter anyway (another method's sequences wanted it), one whose round trip is
no longer is asked too, whatever its gate's own judgement: the drafters answer concurrently, so it adds
no wait, and the cost model verifies only what of its drafts pays (`rides_along`). Under `auto`, whose
sequences want several drafters, probes that each came in steps of their own then come together.

An ask the drafter left unanswered (it is down, failed, or missed its deadline) says nothing of what its
drafts gain, nor of its round trip when it answers: it is kept apart. After MISSES_BEFORE_PROBING in a row
(one is a busy moment: a suffix drafter indexing new prompts missed 3 of 27 asks at 32 clients) the drafter
is asked only as a probe, spaced by what its unanswered asks took (a dead one about every deadline /
PROBE_SHARE seconds), and the first answer puts it back on its answered round trip at once. (Folded into
the round trip, the deadline-long failures of a drafter that was down when the target started spaced the
probes so far apart that a request went unprobed after it came back.)
"""
from __future__ import annotations

from target_svc.drafting.means import moved, warmed
from target_svc.sequence import Sequence

PROBE_EVERY = 8
PROBE_SHARE = 0.02  # what probing a drafter whose drafts never pay may cost, at most, as a share of the time
TYPICAL_EVIDENCE = 16  # sequence-asks before their typical gain is trusted
SMOOTHING = 0.25  # weight of an ask's round trip in their moving mean
# Weight of an asked step's gain in its sequence's mean gain and in the typical gain, once they have seen
# 1 / GAIN_SMOOTHING asks (before, they are the plain mean of the asks so far, so a newcomer's first runs
# count in full). Gains come in runs (a passage copied, then nothing for a while), so the mean must outlast
# the dry spells between them: at 0.25 it forgot a run within a few empty asks and skipped the asks that
# would have found the next one (`ngram` on Spec-Bench at batch 1, bf16, 2-core EPYC: 1.18x `none`, tau
# 1.27; at 0.05 1.21x, tau 1.34; asking every step 1.24x, tau 1.41).
GAIN_SMOOTHING = 0.05
DRIFT = 0.25  # the share of the way back to the typical gain a sequence's expected gain goes per unasked step
MISSES_BEFORE_PROBING = 2  # unanswered asks in a row after which the drafter is asked only as a probe


class DraftingGate:
    def __init__(self):
        # Seconds an ask costs the step, a moving mean (None before the first): its round trip, and what the
        # drafter's work meanwhile slows the forward by (`AskOverhang`).
        self.round_trip: float | None = None
        self.unanswered_round_trip: float | None = None  # the same for the asks that went unanswered
        self.misses = 0  # unanswered asks since the last answered one
        self.typical_gain: float | None = None  # what an ask gained any one sequence, a moving mean
        self.evidence = 0  # sequence-asks the typical gain has seen
        self.unasked_steps = 0  # steps since the last ask, among those with sequences wanting drafts

    def expected_gain(self, seq: Sequence) -> float:
        """What asking for `seq`'s draft is expected to gain the batch, in tokens (typical_gain set). Under
        `auto`, what its chooser expects of the drafter it chose: the sequence's own mean mixes every drafter
        it asked, and judged by it, a drafter chosen for its shadow drafts went unasked for most of its turn."""
        if seq.chooser is not None and (chosen := seq.chooser.expected_gain()) is not None:
            return chosen
        if seq.draft_gain is None:
            return self.typical_gain
        drift = 1.0 - (1.0 - DRIFT) ** seq.unasked_steps
        return seq.draft_gain + drift * (self.typical_gain - seq.draft_gain)

    def worth_asking(self, wanting: list[Sequence], decodes: int, plain_seconds: float, step_seconds: float,
                     drafters: int = 1) -> bool:
        """Whether to ask for `wanting`'s drafts in a step of `decodes` decoding sequences whose newest tokens
        alone take `plain_seconds` a step (the cost model's forward and the step's work besides it), recent
        steps having taken `step_seconds` (prompt chunks, drafts and all), the step's sequences wanting
        `drafters` drafters in all."""
        if not wanting:
            return False
        if self.misses >= MISSES_BEFORE_PROBING:
            return self.unasked_steps >= self._probe_every(self.unanswered_round_trip, step_seconds, drafters)
        if self.round_trip is None or self.evidence < TYPICAL_EVIDENCE:
            return True
        if self.unasked_steps >= self._probe_every(self.round_trip, step_seconds, drafters):
            return True
        decoded_meanwhile = self.round_trip * decodes / plain_seconds if plain_seconds > 0 else 0.0
        return sum(self.expected_gain(s) for s in wanting) > decoded_meanwhile

    def rides_along(self, longest_round_trip: float) -> bool:
        """Whether to ask in a step that waits `longest_round_trip` seconds for other drafters anyway, if
        this drafter's round trip is no longer: its drafts cost then only what the cost model keeps of them.
        Not while it misses asks (its round trip is unknown then)."""
        return (self.round_trip is not None and self.misses < MISSES_BEFORE_PROBING
                and self.round_trip <= longest_round_trip)

    @staticmethod
    def _probe_every(round_trip: float, step_seconds: float, drafters: int) -> float:
        """Steps between probes: PROBE_EVERY, or more where the drafter's typical round trip is long next to
        a step, or its probes share PROBE_SHARE with other drafters'."""
        if step_seconds <= 0:
            return PROBE_EVERY
        return max(PROBE_EVERY, round_trip * drafters / (PROBE_SHARE * step_seconds))

    def asked(self, round_trip: float, gains: list[tuple[Sequence, float]]) -> None:
        """An ask cost the step `round_trip` seconds, and each (sequence, tokens): what the asked sequence's
        draft gained the batch, in tokens (its accepted draft tokens less its draft's price; 0 for no draft)."""
        self.round_trip = moved(self.round_trip, round_trip, SMOOTHING)
        self.misses = 0
        self.unasked_steps = 0
        for seq, tokens in gains:
            seq.unasked_steps = 0
            seq.draft_asks += 1
            seq.draft_gain = warmed(seq.draft_gain, tokens, seq.draft_asks, GAIN_SMOOTHING)
            self.evidence += 1
            self.typical_gain = warmed(self.typical_gain, tokens, self.evidence, GAIN_SMOOTHING)

    def went_unanswered(self, round_trip: float) -> None:
        """An ask cost the step `round_trip` seconds and the drafter did not answer it."""
        self.unanswered_round_trip = moved(self.unanswered_round_trip, round_trip, SMOOTHING)
        self.misses += 1
        self.unasked_steps = 0

    def skipped(self, wanting: list[Sequence]) -> None:
        self.unasked_steps += 1
        for seq in wanting:
            seq.unasked_steps += 1
