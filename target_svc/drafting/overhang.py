"""What asking a drafter costs beyond its round trip: the drafter's own work on the target's cores.

A drafter on the same CPU as the target keeps computing after it answers (indexing a new prompt it
deferred, taking a finished request's output into its global cache), and the forward that runs
meanwhile is that much slower. The step cost model cannot tell why; but the steps that asked a drafter
run over its predictions by more than the steps that could have asked and did not. That excess, per method, is added to
what an ask costs (the gate's round trip), so that where drafts gain the batch less than their drafter
takes from the model, the steps stop asking. (Measured at 32 clients on Spec-Bench prompts the drafters
had not seen, bf16, 2-core EPYC: steps asking ran 6 ms a step further over the prediction than steps
not asking, beside an 11 ms round trip, and `auto` ran at 0.92x `none`.) Until steps of both kinds
have been seen, there is no evidence of an excess, and none is added.
"""
from __future__ import annotations

from collections.abc import Iterable

from target_svc.drafting.means import warmed

# Weight of a step in the means once they have seen 1 / WEIGHT steps: a step's excess varies by tens of
# milliseconds (prompt chunks, the machine's other work), so the means must span some dozens of steps.
WEIGHT = 1 / 32


class AskOverhang:
    def __init__(self):
        self._unasked: float | None = None  # what steps that did not ask ran over the prediction, a mean
        self._unasked_steps = 0
        self._asked: dict[str, float] = {}  # the same for steps asking each method
        self._asked_steps: dict[str, int] = {}

    def observe(self, asked: Iterable[str], excess: float) -> None:
        """A step whose sequences wanted drafts, and that asked the drafters of `asked` (none: empty), ran
        `excess` seconds over the cost model's prediction (less: negative)."""
        methods = list(asked)
        if not methods:
            self._unasked_steps += 1
            self._unasked = warmed(self._unasked, excess, self._unasked_steps, WEIGHT)
        for method in methods:
            count = self._asked_steps[method] = self._asked_steps.get(method, 0) + 1
            self._asked[method] = warmed(self._asked.get(method), excess, count, WEIGHT)

    def seconds(self, method: str) -> float:
        """What an ask of `method` costs the step beyond its round trip."""
        if self._unasked is None or method not in self._asked:
            return 0.0
        return max(0.0, self._asked[method] - self._unasked)
