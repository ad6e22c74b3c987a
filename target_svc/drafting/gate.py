"""Whether a step asks the drafters at all: their round trip against what drafts have been gaining.

While the drafters answer, the model waits; the step cost model does not see that time, and with one
sequence it is about a tenth of a step. So each sequence keeps a moving mean of what an ask gained it
(`Sequence.draft_gain`): the draft tokens accepted, less the decode tokens that verifying its draft
cost the batch (`Scheduled.draft_price`), and a step asks only when the gain the batch expects is
worth more than the tokens the batch would decode in the round trip. Until the drafter first offers a
sequence a draft, an ask that returns none leaves the mean unset (n-gram matches start as soon as the
text repeats); after that it counts as gaining nothing, because its round trip was paid all the same.
A sequence not asked for PROBE_EVERY steps is asked again, so one whose text turns repetitive gets
its drafts back.
"""
from __future__ import annotations

from target_svc.sequence import Sequence

PROBE_EVERY = 4
SMOOTHING = 0.25  # weight of a sequence's newest asked step in its mean gain, and of an ask's round trip


class DraftingGate:
    def __init__(self):
        self.round_trip: float | None = None  # seconds an ask takes, a moving mean; None before the first

    def worth_asking(self, wanting: list[Sequence], decodes: int, step_seconds: float) -> bool:
        """Whether to ask for `wanting`'s drafts in a step of `decodes` decoding sequences, recent steps
        having taken `step_seconds`."""
        if not wanting:
            return False
        if self.round_trip is None or any(s.draft_gain is None or s.unasked_steps >= PROBE_EVERY for s in wanting):
            return True
        decoded_meanwhile = self.round_trip * decodes / step_seconds if step_seconds > 0 else 0.0
        return sum(s.draft_gain for s in wanting) > decoded_meanwhile

    def asked(self, round_trip: float, gains: list[tuple[Sequence, float | None]]) -> None:
        """An ask took `round_trip` seconds, and each (sequence, tokens): what the asked sequence's draft
        gained the batch, in tokens (its accepted draft tokens less its draft's price), None where it
        was offered no draft."""
        self.round_trip = _moved(self.round_trip, round_trip)
        for seq, tokens in gains:
            seq.unasked_steps = 0
            if tokens is not None or seq.draft_gain is not None:
                seq.draft_gain = _moved(seq.draft_gain, tokens or 0.0)

    @staticmethod
    def skipped(wanting: list[Sequence]) -> None:
        for seq in wanting:
            seq.unasked_steps += 1


def _moved(mean: float | None, value: float) -> float:
    """A moving mean after one more value, SMOOTHING its weight; the first value where there is none."""
    return value if mean is None else mean + SMOOTHING * (value - mean)
