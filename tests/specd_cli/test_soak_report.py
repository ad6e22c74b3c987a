"""What a soak's report concludes from what it measured: which processes' memory it compares against which
baseline, and when the stack did not hold."""
import json

import pytest

from specd_cli.soak.chaos import ChaosEvent
from specd_cli.soak.clients import Outcomes
from specd_cli.soak.settings import SoakSettings
from specd_cli.soak.probes import IdleCheck, RssSample
from specd_cli.soak.report import SoakReport

MIB = 1 << 20
FILE_PAGES_MIB = 100  # VmRSS beyond RssAnon: mapped libraries and model, which the kernel may reclaim
SETTINGS = SoakSettings(warm_up_s=10, duration_s=60, rss_tolerance=0.05)
KILL = ChaosEvent("SIGKILL drafter-ngram", at_s=30, took_s=5, detail={"service": "drafter-ngram", "old_pid": 2,
                                                                       "new_pid": 9})


def _sample(service: str, pid: int, at_s: float, anon_mib: float, file_mib: float = FILE_PAGES_MIB) -> RssSample:
    return RssSample(service, pid, at_s, int((anon_mib + file_mib) * MIB), int(anon_mib * MIB))


def _report(end: list[RssSample], samples=(), lost=None, idle=()) -> SoakReport:
    baseline = [_sample("target", 1, 10, 1000), _sample("drafter-ngram", 2, 10, 300),
                _sample("drafter-suffix", 3, 10, 300), _sample("gateway", 4, 10, 400)]
    outcomes = Outcomes(completed=100, cancelled=40)
    outcomes.lost.update(lost or {})
    return SoakReport(SETTINGS, ["none", "ngram"], outcomes, [KILL], 10, baseline, end, [*baseline, *samples, *end],
                      list(idle), drained_s=75)


STEADY = [_sample("target", 1, 70, 1010), _sample("drafter-ngram", 9, 70, 320), _sample("drafter-suffix", 3, 70, 303),
          _sample("gateway", 4, 70, 480)]


def test_memory_is_compared_for_the_target_and_the_drafters_that_lived_through_the_soak():
    report = _report(STEADY)
    assert {row.service: round(row.growth, 3) for row in report.checked_rss()} == \
        {"target": 0.01, "drafter-suffix": 0.01}
    assert report.failures() == []


def test_a_restarted_drafter_is_compared_from_a_warm_up_after_it_served_again():
    # Killed at 30 s, it served again 5 s later: its first sample a warm-up (10 s) after that is its baseline.
    samples = [_sample("drafter-ngram", 9, 40, 200), _sample("drafter-ngram", 9, 45, 310)]
    row = next(row for row in _report(STEADY, samples).rss() if row.service == "drafter-ngram")
    assert (row.since, row.start.anon_bytes) == ("restart, at 45 s", 310 * MIB)


def test_file_pages_the_kernel_reclaimed_do_not_count_as_memory_moving():
    reclaimed = [*STEADY[:2], _sample("drafter-suffix", 3, 70, 300, file_mib=10), STEADY[3]]
    row = next(row for row in _report(reclaimed).rss() if row.service == "drafter-suffix")
    assert row.rss_growth == pytest.approx(310 / 400 - 1) and row.growth == 0
    assert _report(reclaimed).failures() == []


def test_the_soak_fails_on_a_lost_request_memory_moving_past_the_tolerance_or_work_left_after_the_load():
    grown = [*STEADY[:2], _sample("drafter-suffix", 3, 70, 330), STEADY[3]]
    busy = [IdleCheck("target", "specd_kv_cache_blocks_used", 3, after_s=60)]
    failures = _report(grown, lost={"UNAVAILABLE": 2}, idle=busy).failures()
    assert failures == ["2 requests lost: UNAVAILABLE", "drafter-suffix RssAnon moved +10.0% (more than 5%)",
                        "target specd_kv_cache_blocks_used still 3 60 s after the load"]
    assert "FAILED" in _report(grown).text()


def test_the_report_is_written_as_json_with_its_lost_requests_by_code():
    written = json.loads(json.dumps(_report(STEADY, lost={"DEADLINE_EXCEEDED": 3}).to_json()))
    assert written["outcomes"] == {"completed": 100, "cancelled": 40, "lost": {"DEADLINE_EXCEEDED": 3}}
    assert written["failures"] == ["3 requests lost: DEADLINE_EXCEEDED"]
