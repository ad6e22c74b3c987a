"""What the soak reads off the running services: each process's resident memory, from /proc, and the
gauges that must come back to zero once the load has drained, from each service's /metrics.

Resident memory is read twice over: VmRSS, all of it, and RssAnon, the process's own allocations (heap,
tensors, Python objects), which is where a leak grows. The rest of VmRSS is pages of mapped files (shared
libraries, the model), which the kernel drops when it reclaims memory and reads back when they are touched
again: on a machine with proactive reclaim (DAMON) a drafter's VmRSS was seen to fall from 300 to 175 MiB
while it served, its RssAnon unchanged."""
from __future__ import annotations

import asyncio
import time
import urllib.request
from dataclasses import dataclass

from specd_cli.stack import Stack

# The gauges that count work in progress, by the role of the service exporting them: all zero when idle.
IDLE_GAUGES = {
    "gateway": ("specd_gateway_requests_running",),
    "target": ("specd_kv_cache_blocks_used", "specd_requests_running", "specd_requests_waiting"),
    "drafter": ("specd_drafter_sequences",),
}


@dataclass(frozen=True)
class RssSample:
    service: str
    pid: int
    at_s: float  # seconds since the soak began
    rss_bytes: int  # VmRSS
    anon_bytes: int  # RssAnon


@dataclass(frozen=True)
class IdleCheck:
    service: str
    gauge: str
    value: float  # the last value read
    after_s: float  # seconds after the load drained it read zero, or when the check gave up

    @property
    def idle(self) -> bool:
        return self.value == 0


def role_of(service: str) -> str:
    return "drafter" if service.startswith("drafter-") else service


def resident_bytes(pid: int) -> tuple[int, int] | None:
    """The process's VmRSS and RssAnon; None once it has exited."""
    try:
        with open(f"/proc/{pid}/status") as status:
            fields = dict(line.split(":", 1) for line in status if line.startswith(("VmRSS:", "RssAnon:")))
    except (FileNotFoundError, ProcessLookupError):
        return None
    if len(fields) < 2:  # a zombie: exited, not yet reaped
        return None
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["RssAnon"].split()[0]) * 1024


def sample_rss(stack: Stack, at_s: float) -> list[RssSample]:
    """One sample of every live service process (a restarted service is its new process)."""
    samples = []
    for service, process in list(stack.processes.items()):
        if (resident := resident_bytes(process.pid)) is not None:
            samples.append(RssSample(service, process.pid, at_s, *resident))
    return samples


async def typical_rss(stack: Stack, since_began, samples: int = 5, every_s: float = 1.0) -> list[RssSample]:
    """Each live process's median sample (by RssAnon) of `samples` taken `every_s` apart: one instant under
    load also holds the buffers of the step running then (a step's logits alone are ~0.2 MiB a row), which
    moved a target's single samples by 2-4% from one instant to another."""
    taken: dict[int, list[RssSample]] = {}
    for i in range(samples):
        if i:
            await asyncio.sleep(every_s)
        for sample in sample_rss(stack, since_began()):
            taken.setdefault(sample.pid, []).append(sample)
    return [sorted(series, key=lambda s: s.anon_bytes)[len(series) // 2] for series in taken.values()]


def gauge(url: str, name: str) -> float:
    """The value of an unlabelled gauge in a Prometheus text scrape of `url`."""
    with urllib.request.urlopen(url, timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise KeyError(f"{name} not in {url}")


async def wait_idle(stack: Stack, timeout_s: float) -> list[IdleCheck]:
    """Every IDLE_GAUGES gauge of every service, polled until it reads zero or `timeout_s` has passed."""
    started = time.monotonic()
    checks = []
    for service in stack.services:
        for name in IDLE_GAUGES[role_of(service)]:
            while True:
                value = await asyncio.to_thread(gauge, stack.metrics_url(service), name)
                elapsed = time.monotonic() - started
                if value == 0 or elapsed > timeout_s:
                    break
                await asyncio.sleep(0.2)
            checks.append(IdleCheck(service, name, value, round(elapsed, 2)))
    return checks
