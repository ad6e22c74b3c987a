"""The target-side interface of a draft source, remote or in-target.

The step asks every source once per step for all its sequences; a source that fails or is late
answers with fewer drafts (or none), never with an error: drafts are an optimisation.
"""
from __future__ import annotations

from typing import Protocol

from specd.drafts import DraftTree
from specd.options import OptionSchema
from target_svc.sequence import Sequence


class DraftSource(Protocol):
    method: str

    @property
    def schema(self) -> OptionSchema:
        """The method's options, as the method itself declares them."""

    async def start(self) -> None:
        """Ready to propose (a remote source learns its schema here)."""

    async def propose(self, wanted: list[tuple[Sequence, int]]) -> dict[str, DraftTree]:
        """Drafts of at most k tokens for each (sequence, k), by sequence id; missing = no draft."""

    def release(self, sequence: Sequence) -> None:
        """The sequence finished: drop what is kept for it."""

    async def close(self) -> None:
        """Free connections and tasks."""
