"""The faults a soak injects into a running, supervised stack."""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

from specd.client import SpecdClient
from specd_cli.soak.clients import Outcomes, cancel_storm
from specd_cli.soak.request_mix import RequestMix
from specd_cli.stack import Stack


@dataclass
class ChaosEvent:
    what: str
    at_s: float  # seconds since the soak began
    took_s: float = 0.0  # until the fault was over: the service serving again, every stream cancelled
    detail: dict = field(default_factory=dict)


async def kill_and_await_restart(stack: Stack, service: str, at_s: float, timeout_s: float) -> ChaosEvent:
    """SIGKILL `service`'s process and wait for the supervisor's new one to serve."""
    dead = stack.processes[service]
    dead.kill()
    started = time.monotonic()
    deadline = started + timeout_s
    while stack.processes[service] is dead:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the supervisor did not restart {service} within {timeout_s:g} s")
        await asyncio.sleep(0.2)
    await asyncio.to_thread(stack.wait_healthy, service, deadline)
    return ChaosEvent(f"SIGKILL {service}", at_s, round(time.monotonic() - started, 2),
                      {"service": service, "old_pid": dead.pid, "new_pid": stack.processes[service].pid})


async def storm(stack: Stack, mix: RequestMix, rng: random.Random, streams: int, outcomes: Outcomes, at_s: float,
                timeout_s: float | None) -> ChaosEvent:
    """A cancel storm from a client of its own (another connection, as other users would be)."""
    started = time.monotonic()
    before = outcomes.cancelled
    async with SpecdClient(stack.address("gateway")) as client:
        await cancel_storm(client, mix, rng, streams, outcomes, timeout_s)
    return ChaosEvent("cancel storm", at_s, round(time.monotonic() - started, 2),
                      {"streams": streams, "cancelled": outcomes.cancelled - before})
