"""The one interface every drafter-side proposer implements.

A proposer takes the whole batch of a step in one call and returns one draft tree per sequence,
so the servicer never branches on the method. It declares its method name and options as data
(`schema`), proposes up to the number of tokens the target asks for, and estimates each token's
chance of acceptance; the target decides how much of a draft to verify.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

from drafter_svc.sequences import SequenceState
from specd.drafts import DraftTree
from specd.options import OptionSchema, OptionValue


@dataclass(frozen=True)
class DraftRequest:
    """One sequence's share of a Propose call."""
    sequence: SequenceState
    max_tokens: int  # the most draft tokens the target will take this step; 0: index the new tokens only
    options: dict[str, OptionValue]  # every option of the method, resolved by its schema


class Proposer(Protocol):
    schema: ClassVar[OptionSchema]  # the method's name and its options

    def propose(self, batch: list[DraftRequest]) -> list[DraftTree]:
        """One draft per request, in batch order; an empty tree means no draft this step."""

    def release(self, sequence: SequenceState) -> None:
        """The sequence finished (or was evicted); a proposer that learns across sequences learns here."""

    # Optional: `sizes() -> dict[str, int]`, what the proposer keeps across sequences by kind, exported
    # as the specd_drafter_proposer_state gauge; `runs_model = True`, for a proposer that runs a model:
    # the servicer then always calls it on its worker thread, never on the event loop.
