"""Latency of a token stream, computed the same way by every service that observes one."""
from __future__ import annotations

import time

# Histogram buckets (seconds) of every latency metric: TTFT, inter-token latency, end to end.
LATENCY_BUCKETS = (.005, .01, .025, .05, .075, .1, .15, .2, .3, .5, .75, 1, 2.5, 5, 10, 30, 60, 120)


class TokenClock:
    """When a stream's tokens arrive: the time to its first token, then the gap per token of each
    later chunk (a chunk of n tokens after a gap of t seconds: n tokens t/n seconds apart)."""

    def __init__(self, started: float | None = None):
        self.started = time.perf_counter() if started is None else started
        self._last: float | None = None

    def tick(self, num_tokens: int) -> tuple[float | None, float | None]:
        """(time to first token, None) at the first chunk with tokens, (None, seconds per token)
        after it; (None, None) for a chunk without tokens."""
        if num_tokens == 0:
            return None, None
        now, last = time.perf_counter(), self._last
        self._last = now
        if last is None:
            return now - self.started, None
        return None, (now - last) / num_tokens
