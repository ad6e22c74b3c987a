"""Proposers that run inside the target, by method name (served with `--drafter METHOD`, no address).
A new one: one file implementing `DraftSource`, one `register` line here (with the class: the CLI reads
its `schema` for flags)."""
from __future__ import annotations

from typing import Callable

from target_svc.drafting.base import DraftSource
from target_svc.drafting.lookahead import METHOD as LOOKAHEAD_METHOD, LookaheadSource

IN_TARGET_SOURCES: dict[str, Callable[[], DraftSource]] = {}


def register(method: str, factory: Callable[[], DraftSource]) -> None:
    IN_TARGET_SOURCES[method] = factory


register(LOOKAHEAD_METHOD, LookaheadSource)
