"""A proposer that runs a model: its torch side (drafter_svc.models) is loaded only where the method is served,
so the CPU drafters and the CLI start without torch."""
from __future__ import annotations

from drafter_svc.proposers.base import DraftRequest
from drafter_svc.sequences import SequenceState
from specd.drafts import DraftTree


class ModelProposer:
    runs_model = True  # called on the worker thread only: model compute never runs on the event loop
    model = None  # set by the subclass: a drafter_svc.models.base.ModelDrafter

    def propose(self, batch: list[DraftRequest]) -> list[DraftTree]:
        return self.model.propose(batch)

    def release(self, sequence: SequenceState) -> None:
        self.model.release(sequence)

    def sizes(self) -> dict[str, int]:
        return self.model.sizes()
