"""The target-side interface of a draft source, remote or in-target.

The step asks every source once per step for all its sequences; a source that fails or is late
answers with None (no answer) or fewer drafts, never with an error: drafts are an optimisation.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Protocol, runtime_checkable

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

    async def propose(self, wanted: list[tuple[Sequence, int]]) -> dict[str, DraftTree] | None:
        """Drafts of at most k tokens for each (sequence, k), by sequence id; missing = no draft; None: the
        source did not answer (it failed or missed its deadline)."""

    def release(self, sequence: Sequence) -> None:
        """The sequence finished: drop what is kept for it."""

    async def close(self) -> None:
        """Free connections and tasks."""


@dataclass(frozen=True)
class Window:
    """Guesses that ride in the target's own forward beside a sequence's draft, for an in-target source
    to learn from (lookahead's Jacobi window): a token tree like a draft's (parents before children, -1:
    the sequence's newest token), whose K/V are dropped after the step, and the nodes whose argmax the
    source wants back. `expected_yield`: the draft tokens a step with the window is expected to bring
    the sequence; the target runs the window only where that pays for its tokens."""
    token_ids: tuple[int, ...]
    parents: tuple[int, ...]
    guess_nodes: tuple[int, ...]
    expected_yield: float

    def __len__(self) -> int:
        return len(self.token_ids)

    def depths(self) -> list[int]:
        return self._depths

    @cached_property  # the step prices the window, then lays it out
    def _depths(self) -> list[int]:
        return DraftTree(self.token_ids, self.parents, (1.0,) * len(self)).depths()


@runtime_checkable
class WindowSource(DraftSource, Protocol):
    """A source whose guesses ride in the target's forward and learn from its argmax there."""

    def window(self, sequence: Sequence) -> Window | None:
        """The window to run beside the sequence's draft this step, if any."""

    def observe(self, sequence: Sequence, guesses: list[int], num_verified: int,
                accepted_nodes: tuple[int, ...]) -> None:
        """The step ran: the target's argmax at each of the window's guess nodes (none if the window did
        not run), how many of the draft's first nodes it verified, and those it accepted."""
