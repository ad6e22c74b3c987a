"""Which of a step's sequences a drafter is asked for, if any: its round trip against what their drafts
have been gaining (each drafter has its own gate).

While the drafters answer, the model waits; the step cost model does not see that time, and with one
sequence it is about a tenth of a step. So each sequence keeps a moving mean of what an ask gained it
(`Sequence.draft_gain`): the draft tokens accepted, less the decode tokens that verifying its draft
cost the batch (`Scheduled.draft_price`); an ask that offered it nothing gained nothing, because its
round trip was paid all the same. The round trip is a line in the sequences asked (`RoundTripLine`): a
fixed part, and a part per sequence (its update and its draft, in the drafter's Python: ~0.25 ms for
`suffix` and `trie`, so 64 sequences take ~17 ms; split evenly until the counts asked vary). A step asks
for the sequences expected to gain more than their own part costs, and only when together they gain more
than the fixed part too; both priced
in the tokens the batch would decode meanwhile, decoding plainly (the cost model's price of the
decodes' newest tokens alone, and what every step costs besides its forward: prompt chunks riding in
the steps are done whatever is asked, and counted in, they made a round trip look cheap under load).
Asking for the whole batch or none, a few sequences copying a passage were asked for only when the rest
came along, at 64 clients in about a third of the steps, each ask ~20 ms of a ~160 ms step.

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
no longer is asked too, whatever its gate's own judgement, for as many sequences as keep it no longer
(those expected to gain most first): the drafters answer concurrently, so it adds no wait, and the cost
model verifies only what of its drafts pays (`riding`). Under `auto`, whose sequences want several
drafters, probes that each came in steps of their own then come together.

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
LINE_SMOOTHING = 0.1  # weight of an ask in the line its round trip is fitted to (a slope needs a longer memory)
# Spread of the sequence counts asked (their variance) below which the line is taken as all slope: the round
# trip is split evenly between the sequences asked, so each is asked for only while it pays for its share, and
# the counts asked come to vary. (All fixed part, a batch whose few copying sequences could not pay for the
# whole batch's round trip would ask for the same whole batch, or none of it, for good.)
MIN_SPREAD = 1.0
# Weight of an asked step's gain in its sequence's mean gain and in the typical gain, once they have seen
# 1 / GAIN_SMOOTHING asks (before, they are the plain mean of the asks so far, so a newcomer's first runs
# count in full). Gains come in runs (a passage copied, then nothing for a while), so the mean must outlast
# the dry spells between them: at 0.25 it forgot a run within a few empty asks and skipped the asks that
# would have found the next one (`ngram` on Spec-Bench at batch 1, bf16, 2-core EPYC: 1.18x `none`, tau
# 1.27; at 0.05 1.21x, tau 1.34; asking every step 1.24x, tau 1.41).
GAIN_SMOOTHING = 0.05
DRIFT = 0.25  # the share of the way back to the typical gain a sequence's expected gain goes per unasked step
MISSES_BEFORE_PROBING = 2  # unanswered asks in a row after which the drafter is asked only as a probe


class RoundTripLine:
    """An ask's seconds as `fixed + per_sequence x sequences asked`, by least squares over moving means."""

    def __init__(self):
        self._means: tuple[float, float, float, float] | None = None  # of n, seconds, n², n x seconds

    def observe(self, sequences: int, seconds: float) -> None:
        values = (sequences, seconds, sequences * sequences, sequences * seconds)
        self._means = values if self._means is None else tuple(
            mean + LINE_SMOOTHING * (value - mean) for mean, value in zip(self._means, values))

    def fit(self) -> tuple[float, float]:
        """(fixed, per_sequence) seconds: (0, 0) before any ask."""
        if self._means is None:
            return 0.0, 0.0
        n, seconds, nn, n_seconds = self._means
        spread = nn - n * n
        if spread < MIN_SPREAD:
            return 0.0, seconds / n
        # Within what the asks took on average: noise must not make the fixed part negative, nor a sequence free.
        per_sequence = min(max(0.0, (n_seconds - n * seconds) / spread), seconds / n)
        return seconds - per_sequence * n, per_sequence

    def seconds(self, sequences: int) -> float:
        fixed, per_sequence = self.fit()
        return fixed + per_sequence * sequences


class DraftingGate:
    def __init__(self):
        # Seconds an ask costs the step, a moving mean (None before the first): its round trip, and what the
        # drafter's work meanwhile slows the forward by (`AskOverhang`).
        self.round_trip: float | None = None
        self.line = RoundTripLine()  # the same by the sequences asked
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

    def to_ask(self, wanting: list[Sequence], decodes: int, plain_seconds: float, step_seconds: float,
               drafters: int = 1) -> list[Sequence]:
        """The sequences of `wanting` to ask drafts for (none: skip the drafter this step), in a step of
        `decodes` decoding sequences whose newest tokens alone take `plain_seconds` a step (the cost model's
        forward and the step's work besides it), recent steps having taken `step_seconds` (prompt chunks,
        drafts and all), the step's sequences wanting `drafters` drafters in all."""
        if not wanting:
            return []
        if self.misses >= MISSES_BEFORE_PROBING:
            probe_due = self.unasked_steps >= self._probe_every(self.unanswered_round_trip, step_seconds, drafters)
            return list(wanting) if probe_due else []
        if self.round_trip is None or self.evidence < TYPICAL_EVIDENCE:
            return list(wanting)
        if self.unasked_steps >= self._probe_every(self.round_trip, step_seconds, drafters):
            return list(wanting)
        # Seconds of the round trip priced in the tokens the batch would decode meanwhile.
        fixed, per_sequence = self.line.fit()
        tokens_a_second = decodes / plain_seconds if plain_seconds > 0 else 0.0
        part = per_sequence * tokens_a_second
        # Each sequence expected to gain more than its part costs, with what it gains beyond that.
        worth = [(seq, gain - part) for seq in wanting if (gain := self.expected_gain(seq)) > part]
        return [seq for seq, _ in worth] if sum(net for _, net in worth) > fixed * tokens_a_second else []

    def riding(self, wanting: list[Sequence], longest_round_trip: float) -> list[Sequence]:
        """The sequences of `wanting` to ask for in a step that waits `longest_round_trip` seconds for other
        drafters anyway: as many as an ask of no longer can carry, those expected to gain most first. None
        while the drafter misses asks (what it takes to answer is unknown then)."""
        if self.round_trip is None or self.misses >= MISSES_BEFORE_PROBING:
            return []
        fixed, per_sequence = self.line.fit()
        if fixed > longest_round_trip:
            return []
        room = len(wanting) if per_sequence == 0.0 else int((longest_round_trip - fixed) / per_sequence)
        return sorted(wanting, key=self.expected_gain, reverse=True)[:room]

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
        if gains:
            self.line.observe(len(gains), round_trip)
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
        """A step asked the drafter for none of `wanting`."""
        self.unasked_steps += 1
        self.left_out(wanting)

    @staticmethod
    def left_out(sequences: list[Sequence]) -> None:
        """A step asked the drafter for others, not for `sequences`."""
        for seq in sequences:
            seq.unasked_steps += 1
