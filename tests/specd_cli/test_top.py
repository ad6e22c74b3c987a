"""`specd top`: the numbers it derives from /metrics, and its exit status when nothing answers
(tests/deploy/test_top.py runs it against a real stack)."""
from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

from specd_cli.top import Snapshot, histogram_quantile, parse_scrape, render

TARGET_TEXT = """\
# TYPE specd_output_tokens counter
specd_output_tokens_total{{method="ngram"}} {output}
# TYPE specd_draft_tokens counter
specd_draft_tokens_total{{method="ngram"}} 40
# TYPE specd_accepted_tokens counter
specd_accepted_tokens_total{{method="ngram"}} 30
# TYPE specd_verification_steps counter
specd_verification_steps_total{{method="ngram"}} 20
# TYPE specd_requests_running gauge
specd_requests_running 2
# TYPE specd_requests_waiting gauge
specd_requests_waiting 1
# TYPE specd_kv_cache_blocks_used gauge
specd_kv_cache_blocks_used 16
# TYPE specd_kv_cache_blocks_total gauge
specd_kv_cache_blocks_total 64
# TYPE specd_preemptions counter
specd_preemptions_total 2
# TYPE specd_prefill_chunks counter
specd_prefill_chunks_total 5
# TYPE specd_step_draft_tokens histogram
specd_step_draft_tokens_bucket{{le="+Inf"}} {steps}
specd_step_draft_tokens_count {steps}
specd_step_draft_tokens_sum {drafts}
# TYPE specd_predicted_step_tokens counter
specd_predicted_step_tokens_total {predicted}
# TYPE specd_realized_step_tokens counter
specd_realized_step_tokens_total {output}
# TYPE specd_drafter_rpc_failures counter
specd_drafter_rpc_failures_total{{method="ngram",code="DEADLINE_EXCEEDED"}} 3
# TYPE specd_drafter_rpc_seconds histogram
specd_drafter_rpc_seconds_bucket{{method="ngram",le="0.001"}} 1
specd_drafter_rpc_seconds_bucket{{method="ngram",le="0.01"}} 9
specd_drafter_rpc_seconds_bucket{{method="ngram",le="+Inf"}} 10
specd_drafter_rpc_seconds_count{{method="ngram"}} 10
specd_drafter_rpc_seconds_sum{{method="ngram"}} 0.05
"""


def _table(view: str, header: str) -> dict[str, list[str]]:
    """The rows of the table whose header line starts with `header`, split into cells, by first cell."""
    lines = view.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(header + " ")) + 1
    return {row.split()[0]: row.split() for row in itertools.takewhile(bool, lines[first:])}


def _snapshot(taken_at: float, output_tokens: int) -> Snapshot:
    target = parse_scrape("http://target/metrics", TARGET_TEXT.format(
        output=output_tokens, steps=output_tokens // 4, drafts=output_tokens // 2, predicted=output_tokens * 1.1))
    unreachable = parse_scrape("http://gateway/metrics", "")
    unreachable.error = "Connection refused"
    return Snapshot(taken_at, target, unreachable, [])


def test_quantile_interpolates_within_the_bucket_like_prometheus():
    buckets = [(0.1, 2), (0.2, 4), (float("inf"), 4)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.75, buckets) == pytest.approx(0.15)


def test_quantile_in_the_open_top_bucket_is_the_largest_finite_bound():
    assert histogram_quantile(0.9, [(0.1, 1), (float("inf"), 10)]) == 0.1


def test_quantile_of_an_empty_histogram_is_unknown():
    assert histogram_quantile(0.5, [(0.1, 0), (float("inf"), 0)]) is None
    assert histogram_quantile(0.5, []) is None


def test_the_view_shows_per_method_acceptance_throughput_and_drafter_failures():
    view = render(_snapshot(10.0, output_tokens=100), _snapshot(12.0, output_tokens=160))
    out_per_s, _, _, rate, length = _table(view, "method")["ngram"][1:6]
    assert out_per_s == "30.0"   # 60 tokens in 2 s
    assert rate == "75.0%"       # 30 accepted of 40 drafted
    assert length == "2.50"      # 1 + 30 accepted / 20 steps
    assert "running 2   waiting 1" in view
    assert "16 / 64 blocks (25.0%)" in view
    assert "DEADLINE_EXCEEDED 3" in view


def test_the_view_shows_the_schedulers_choices_next_to_what_they_gave():
    view = render(_snapshot(10.0, output_tokens=100), _snapshot(12.0, output_tokens=160))
    assert "preemptions 2   prefill chunks 5" in view
    assert "drafts/step 2.0" in view  # 30 draft tokens over 15 steps
    assert "tokens predicted 66 / realized 60" in view


def test_an_unreachable_service_is_shown_not_fatal():
    view = render(_snapshot(0.0, 0), _snapshot(1.0, 0))
    assert "http://gateway/metrics unreachable: Connection refused" in view


def test_top_exits_1_when_no_service_answers():
    nowhere = "http://127.0.0.1:9/metrics"
    result = subprocess.run([sys.executable, "-m", "specd_cli.main", "top", "--once", "--interval", "0",
                             "--target-metrics", nowhere, "--gateway-metrics", nowhere, "--drafter-metrics", nowhere],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "unreachable" in result.stdout
