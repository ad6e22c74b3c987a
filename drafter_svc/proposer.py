"""The one interface every drafter implements (drafter_svc/registry.py lists the drafters by method name).

Every proposer takes the whole batch of a step in one call and returns one
draft per sequence, so the servicer never branches on the method.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from drafter_svc.sequences import SequenceState
from specd.errors import InvalidArgument
from specd.types import MAX_SPECULATIVE_TOKENS
from specd.v1 import drafter_pb2


@dataclass(frozen=True)
class DraftParams:
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int

    def validate(self, field_prefix: str) -> None:
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise InvalidArgument(f"{field_prefix}.num_speculative_tokens",
                                  f"must be in 0..{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}")
        if self.prompt_lookup_min < 1:
            raise InvalidArgument(f"{field_prefix}.prompt_lookup_min", f"must be >= 1, got {self.prompt_lookup_min}")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise InvalidArgument(f"{field_prefix}.prompt_lookup_max", f"must be >= prompt_lookup_min "
                                  f"({self.prompt_lookup_min}), got {self.prompt_lookup_max}")

    @classmethod
    def from_pb(cls, pb: drafter_pb2.DraftParams) -> DraftParams:
        return cls(pb.num_speculative_tokens, pb.prompt_lookup_min, pb.prompt_lookup_max)


class Proposer(Protocol):
    method: str

    def propose(self, batch: list[tuple[SequenceState, DraftParams]]) -> list[list[int]]:
        """One draft per sequence, in batch order; [] means no draft this step."""

    def release(self, seq: SequenceState) -> None:
        """The sequence finished; a drafter that learns across sequences learns from it here."""

