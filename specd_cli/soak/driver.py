"""One soak of a running, supervised stack: clients for a warm-up and then the measured part, the chaos
inside the measured part, memory sampled throughout, and the idle check once the load has drained."""
from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Iterator

from specd.client import SpecdClient
from specd_cli.bench.prompts import Prompt
from specd_cli.soak import chaos
from specd_cli.soak.clients import Outcomes, run_client
from specd_cli.soak.probes import sample_rss, typical_rss, wait_idle
from specd_cli.soak.report import SoakReport
from specd_cli.soak.settings import SoakSettings
from specd_cli.soak.request_mix import RequestMix
from specd_cli.stack import Stack, StackPorts


def soak_stack(settings: SoakSettings, **stack_settings) -> Stack:
    """The stack a soak runs: `specd up`'s, on free ports, the learning drafters at the soak's bounds."""
    return Stack(ports=StackPorts.free(), drafter_args=settings.drafter_args(), **stack_settings)


@contextlib.contextmanager
def supervised(stack: Stack, up_timeout_s: float = 900.0) -> Iterator[Stack]:
    """`stack` up, with the supervisor restarting whatever dies, as `specd up` runs it; all stopped on exit.
    The target alone takes minutes to start on a busy machine (it profiles its step cost)."""
    stop = threading.Event()
    supervisor = threading.Thread(target=stack.supervise, args=(stop,), name="supervisor")
    try:
        stack.up(up_timeout_s)
        supervisor.start()
        yield stack
    finally:
        stop.set()
        if supervisor.is_alive():
            supervisor.join()
        else:
            stack.down()


async def soak(stack: Stack, settings: SoakSettings, prompts: list[Prompt], methods: list[str]) -> SoakReport:
    mix = RequestMix(prompts, methods, settings.max_tokens)
    outcomes, stop = Outcomes(), asyncio.Event()
    began = time.monotonic()
    samples = sample_rss(stack, 0.0)

    def since_began() -> float:
        return round(time.monotonic() - began, 2)

    async def sample_memory() -> None:
        while True:
            await asyncio.sleep(settings.sample_every_s)
            samples.extend(sample_rss(stack, since_began()))

    def storm(seed: int):
        return lambda: chaos.storm(stack, mix, random.Random(seed), settings.storm_streams, outcomes, since_began(),
                                   settings.request_timeout_s)

    async def warmed_up() -> None:
        await asyncio.sleep(settings.warm_up_s)
        while outcomes.completed < settings.warm_up_requests_per_client * settings.clients:
            await asyncio.sleep(0.5)

    async def after(seconds: float, fault) -> chaos.ChaosEvent:
        await asyncio.sleep(seconds)
        return await fault()

    async with SpecdClient(stack.address("gateway")) as client:
        clients = [asyncio.create_task(run_client(client, mix, random.Random(settings.seed + i), outcomes, stop,
                                                  settings.request_timeout_s)) for i in range(settings.clients)]
        sampler = asyncio.create_task(sample_memory())
        # A storm in the warm-up too: the memory its peak takes (buffers of the largest steps, which the
        # allocator keeps) is then in the baseline, and the measured storm is a repeat, as a leak's is not.
        warm_up = [after(0, storm(settings.seed - 1))] if settings.storm_streams else []
        events = [event for event in await asyncio.gather(warmed_up(), *warm_up) if event]
        measured_from_s = since_began()
        baseline = await typical_rss(stack, since_began)
        faults = []
        if settings.kill:
            faults.append(after(settings.kill_time_s, lambda: chaos.kill_and_await_restart(
                stack, settings.kill, since_began(), settings.restart_timeout_s)))
        if settings.storm_streams:
            faults.append(after(settings.storm_time_s, storm(settings.seed - 2)))
        measured_chaos = asyncio.gather(*faults)
        await asyncio.sleep(settings.duration_s)
        end = await typical_rss(stack, since_began)
        stop.set()
        await asyncio.gather(*clients)
        events += await measured_chaos
        sampler.cancel()
        drained_s = since_began()
    idle = await wait_idle(stack, settings.idle_timeout_s)
    return SoakReport(settings, methods, outcomes, sorted(events, key=lambda e: e.at_s), measured_from_s, baseline,
                      end, [*samples, *baseline, *end], idle, drained_s)
