"""Real services on loopback for the fuzz tests: a drafter (ngram), a target on the tiny random model that
asks it for drafts, and a gateway (the real tokenizer) in front of the target. They run on an event loop
of their own in a background thread, so the tests are plain functions driving them over synchronous
channels, one hypothesis example after another.

The budget is a hypothesis profile chosen by SPECD_FUZZ_PROFILE: `ci` (the default) runs a bounded, fixed set of
examples on every test run, the same each time; `release` runs many more, new ones each run, before a release:
`SPECD_FUZZ_PROFILE=release .venv/bin/python -m pytest -p no:cacheprovider tests/fuzz` (docs/fuzzing.md)."""
from __future__ import annotations

import asyncio
import os
import threading

import pytest
from hypothesis import HealthCheck, settings

from specd.types import SpeculativeConfig

# Examples are real RPCs (a few milliseconds each, a generation step included): slow by hypothesis'
# measure, and some are megabytes on purpose. No example database: each run explores afresh.
_UNHURRIED = dict(deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                         HealthCheck.large_base_example])
settings.register_profile("specd-fuzz-ci", max_examples=50, derandomize=True, **_UNHURRIED)
settings.register_profile("specd-fuzz-release", max_examples=2000, **_UNHURRIED)
settings.load_profile(f"specd-fuzz-{os.environ.get('SPECD_FUZZ_PROFILE', 'ci')}")


class LoopThread:
    """An event loop running in a daemon thread; `run` waits for a coroutine on it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fuzzed-services", daemon=True)
        self._thread.start()

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def close(self) -> None:
        self.run(_cancel_the_rest())  # calls the stopped services left behind, so none is destroyed pending
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


async def _cancel_the_rest() -> None:
    rest = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in rest:
        task.cancel()
    await asyncio.gather(*rest, return_exceptions=True)


@pytest.fixture(scope="package")
def services_loop():
    loop = LoopThread()
    yield loop
    loop.close()


async def _started(make):
    service = make()  # made on the services' loop: a gRPC aio server belongs to the loop it is made on
    await service.start()
    return service


@pytest.fixture(scope="package")
def drafter(services_loop):
    from drafter_svc.server import create_service

    service = services_loop.run(_started(lambda: create_service("ngram", "127.0.0.1:0", metrics_address=None)))
    yield service
    services_loop.run(service.stop(grace=0))


@pytest.fixture(scope="package")
def target(services_loop, tiny_model_dir, drafter):
    from target_svc.server import TargetOptions, TargetService

    options = TargetOptions(model=str(tiny_model_dir), address="127.0.0.1:0", metrics_address=None,
                            drafters={"ngram": drafter.grpc_address}, kv_cache_tokens=2048, default_max_tokens=8,
                            default_speculative=SpeculativeConfig("ngram", 4, {"prompt_lookup_min": 1}))
    service = services_loop.run(_started(lambda: TargetService(options)))
    yield service
    services_loop.run(service.stop(grace=0))


@pytest.fixture(scope="package")
def gateway(services_loop, target):
    from gateway.server import create_service
    from specd.model_store import DEFAULT_MODEL

    async def started():
        service = await create_service(DEFAULT_MODEL, target.grpc_address, address="127.0.0.1:0",
                                       metrics_address=None, default_speculative=SpeculativeConfig("ngram", 4))
        await service.start()
        return service

    service = services_loop.run(started())
    yield service
    services_loop.run(service.stop(grace=0))
