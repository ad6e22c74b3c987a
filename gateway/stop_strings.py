"""Cut streamed text before the first stop string.

The text arrives in deltas, and a stop string may span several of them, so
the tail of the text that could still begin a stop string is held back until
the next delta settles it. "First" means the earliest start in the text: when
a stop string matches while an earlier-starting, longer one is still only
partly there, the matcher waits for that one to either complete or fail.
"""
from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    def __init__(self, stop_strings: Sequence[str]):
        if any(not stop for stop in stop_strings):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(stop_strings)
        self._held = ""
        self.matched = False

    def feed(self, delta: str) -> str:
        """The part of the text so far that is certainly before any stop string and not emitted yet."""
        text = self._held + delta
        match_start = self._first_match(text)
        partial_start = self._first_partial(text, before=len(text) if match_start is None else match_start)
        if match_start is not None and partial_start is None:
            self.matched, self._held = True, ""
            return text[:match_start]
        cut = len(text) if partial_start is None else partial_start
        self._held = text[cut:]
        return text[:cut]

    def finish(self) -> str:
        """The held-back text once no more will come: all of it, or what precedes a stop string in it."""
        text, self._held = self._held, ""
        match_start = self._first_match(text)
        if match_start is None:
            return text
        self.matched = True
        return text[:match_start]

    def _first_match(self, text: str) -> int | None:
        starts = [start for start in (text.find(stop) for stop in self._stops) if start >= 0]
        return min(starts, default=None)

    def _first_partial(self, text: str, before: int) -> int | None:
        """The earliest start (< before) of a tail of text that a stop string begins with but is longer than."""
        longest = max((len(stop) for stop in self._stops), default=0)
        for start in range(max(0, len(text) - longest + 1), before):
            tail = text[start:]
            if any(len(stop) > len(tail) and stop.startswith(tail) for stop in self._stops):
                return start
        return None
