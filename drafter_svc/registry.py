"""The drafters this service can serve, by method name: a new proposer is one line here."""
from __future__ import annotations

from typing import Callable

from drafter_svc.draft_length import DraftLengthPolicy
from drafter_svc.ngram import NgramProposer
from drafter_svc.proposer import Proposer

PROPOSERS: dict[str, Callable[[DraftLengthPolicy], Proposer]] = {
    NgramProposer.method: NgramProposer,
}
