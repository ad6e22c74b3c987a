"""What a soak found, as text and as JSON, and the ways it failed (none: the stack held)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from specd_cli.soak.chaos import ChaosEvent
from specd_cli.soak.clients import Outcomes
from specd_cli.soak.probes import IdleCheck, RssSample, role_of
from specd_cli.soak.settings import SoakSettings

MIB = 1 << 20
# Resident memory must stay flat in these roles' processes: they hold state per sequence.
RSS_CHECKED_ROLES = ("target", "drafter")


@dataclass(frozen=True)
class RssGrowth:
    service: str
    since: str  # "warm-up", or for a restarted service when its baseline was taken
    start: RssSample
    end: RssSample

    @property
    def growth(self) -> float:
        """Of RssAnon, the process's own allocations: what is checked (VmRSS also moves with file pages the
        kernel reclaims, see probes)."""
        return self.end.anon_bytes / self.start.anon_bytes - 1

    @property
    def rss_growth(self) -> float:
        return self.end.rss_bytes / self.start.rss_bytes - 1


@dataclass
class SoakReport:
    settings: SoakSettings
    methods: list[str]
    outcomes: Outcomes
    chaos: list[ChaosEvent]
    measured_from_s: float  # the warm-up's end (it lasts until its storm is over), in seconds since the start
    baseline: list[RssSample]  # every service after the warm-up
    end: list[RssSample]  # every service at the end of the measured part, still under load
    samples: list[RssSample]  # every service every few seconds, from the start
    idle: list[IdleCheck]  # once the load had drained
    drained_s: float  # seconds from the start until the last client's last request ended

    def rss(self) -> list[RssGrowth]:
        """Each process alive at the end against its own baseline: the one after the warm-up, or for a
        process the supervisor started during the soak, its first sample a warm-up after it served
        (none if the soak ended sooner)."""
        at_baseline = {s.pid: s for s in self.baseline}
        rows = []
        for last in self.end:
            if first := at_baseline.get(last.pid):
                rows.append(RssGrowth(last.service, "warm-up", first, last))
            elif first := self._baseline_after_restart(last):
                rows.append(RssGrowth(last.service, f"restart, at {first.at_s:g} s", first, last))
        return rows

    def _baseline_after_restart(self, last: RssSample) -> RssSample | None:
        served_at = next((e.at_s + e.took_s for e in self.chaos if e.detail.get("new_pid") == last.pid), None)
        if served_at is None:
            return None
        return next((s for s in self.samples if s.pid == last.pid and served_at + self.settings.warm_up_s <= s.at_s
                     < last.at_s), None)

    def checked_rss(self) -> list[RssGrowth]:
        """The rows memory must stay flat in: RSS_CHECKED_ROLES' processes that lived through the whole
        measured part (a restarted one's baseline is younger, taken while it was still warming up)."""
        return [row for row in self.rss() if row.since == "warm-up" and role_of(row.service) in RSS_CHECKED_ROLES]

    def failures(self) -> list[str]:
        """Why the soak failed: lost requests, memory not flat within the tolerance (either way: a fall is
        buffers of the load's peaks let go, which the baseline then held), work left in progress after the load."""
        failed = [f"{count} requests lost: {code}" for code, count in self.outcomes.lost.items()]
        failed += [f"{row.service} RssAnon moved {row.growth:+.1%} (more than {self.settings.rss_tolerance:.0%})"
                   for row in self.checked_rss() if abs(row.growth) > self.settings.rss_tolerance]
        failed += [f"{check.service} {check.gauge} still {check.value:g} {self.settings.idle_timeout_s:g} s after "
                   f"the load" for check in self.idle if not check.idle]
        return failed

    def text(self) -> str:
        s = self.settings
        lines = [f"soak: {s.clients} clients, warm-up until {self.measured_from_s:g} s, then {s.duration_s:g} s "
                 f"measured; max_tokens up to {s.max_tokens}, methods {','.join(self.methods)}; load drained at "
                 f"{self.drained_s:g} s",
                 f"requests: {self.outcomes.completed} completed, {self.outcomes.cancelled} cancelled by the storm, "
                 f"{self.outcomes.lost_total} lost" +
                 (f" ({', '.join(f'{c}: {n}' for c, n in self.outcomes.lost.items())})" if self.outcomes.lost else "")]
        lines += [f"chaos at {e.at_s:g} s: {e.what}, over after {e.took_s:g} s "
                  f"({', '.join(f'{k} {v}' for k, v in e.detail.items())})" for e in self.chaos]
        lines.append(f"{'memory (MiB)':16} {'baseline':22} {'RssAnon':>8} {'':>8} {'':>7}   {'VmRSS':>8}")
        lines.append(f"{'':16} {'':22} {'start':>8} {'end':>8} {'growth':>7}   {'start':>8} {'end':>8} {'growth':>7}")
        lines += [f"{row.service:16} {row.since:22} {row.start.anon_bytes / MIB:8.1f} {row.end.anon_bytes / MIB:8.1f} "
                  f"{row.growth:+7.1%}   {row.start.rss_bytes / MIB:8.1f} {row.end.rss_bytes / MIB:8.1f} "
                  f"{row.rss_growth:+7.1%}" for row in self.rss()]
        lines.append(f"after the load (each gauge polled for up to {s.idle_timeout_s:g} s):")
        lines += [f"  {c.service:16} {c.gauge:34} {c.value:g}" + (f" after {c.after_s:g} s" if c.idle else " NOT IDLE")
                  for c in self.idle]
        failed = self.failures()
        lines.append("verdict: " + ("held: nothing lost, memory flat, back to idle" if not failed
                                    else "FAILED: " + "; ".join(failed)))
        return "\n".join(lines)

    def to_json(self) -> dict:
        # asdict would rebuild the Counter of lost requests from its items, counting (code, n) pairs
        outcomes = {"completed": self.outcomes.completed, "cancelled": self.outcomes.cancelled,
                    "lost": dict(self.outcomes.lost)}
        return {**asdict(self), "outcomes": outcomes, "lost_total": self.outcomes.lost_total,
                "rss": [{**asdict(row), "growth": row.growth, "rss_growth": row.rss_growth} for row in self.rss()],
                "failures": self.failures()}
