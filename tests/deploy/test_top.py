"""`specd top --once` against the stack the deployment tests share (it has served three requests)."""
from __future__ import annotations

import itertools
import subprocess
import sys

import pytest


def _table(view: str, header: str) -> dict[str, list[str]]:
    """The rows of the table whose header line starts with `header`, split into cells, by first cell."""
    lines = view.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(header + " ")) + 1
    return {row.split()[0]: row.split() for row in itertools.takewhile(bool, lines[first:])}


@pytest.mark.e2e
def test_top_once_shows_the_running_stack(stack):
    result = subprocess.run([sys.executable, "-m", "specd_cli.main", "top", "--once", "--interval", "0.5",
                             "--target-metrics", stack.metrics_url("target"),
                             "--gateway-metrics", stack.metrics_url("gateway"),
                             "--drafter-metrics", stack.metrics_url("drafter-ngram")],
                            capture_output=True, text=True, timeout=60, check=True)
    assert "unreachable" not in result.stdout
    methods = _table(result.stdout, "method")
    assert float(methods["ngram"][5]) > 1.0        # the requests' n-gram drafts were partly accepted
    assert methods["none"][4:6] == ["-", "1.00"]   # no drafts: no acceptance rate, one token per step
    assert _table(result.stdout, "drafter")["ngram"][1] != "-"   # the target's Propose RPC latency
    assert "Generate: OK 3" in result.stdout       # the three requests the stack fixture sent
