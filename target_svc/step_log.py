"""`--step-log FILE`: one JSON line per target step, to read a run step by step where the metrics average
it away. (Read this way, a learning drafter's probes at 64 clients took 20-40 ms each, every ~2.3 s, and
brought drafts the cost model dropped: its whole cost under load, 1.2-1.3% of the time, which totals over
the run did not show.)

Each line: `started` (Unix seconds), `seconds` (the whole step), `forward_seconds` (forward and
verification), `round_trip_seconds` (waiting for the drafters), `decodes`, `prefill_tokens`,
`prefill_sequences`, `asked` (sequences asked, by method), `draft_tokens` (verified), `accepted_tokens`,
`running` and `waiting` (sequences, after the step), and `speedup` (the decodes' tokens per second over
plain decoding's, a moving mean: what `auto` prices drafting time at).
"""
from __future__ import annotations

import json
from pathlib import Path


class StepLog:
    def __init__(self, path: str | Path):
        self._file = open(path, "a", buffering=1, encoding="utf-8")  # a line at a time: readable while it runs

    def write(self, **step) -> None:
        self._file.write(json.dumps(step) + "\n")

    def close(self) -> None:
        self._file.close()
