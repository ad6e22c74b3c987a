"""The server bootstrap every service shares: what its grpc.health.v1 reports, and how it runs until signalled."""
import asyncio
import gc
import os
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from specd.serving import LIVENESS, NOT_SERVING, SERVING, Service, serve_until_signalled


@pytest.fixture
async def service():
    service = Service("test", [], "127.0.0.1:0", None, CollectorRegistry())
    await service.start()
    yield service
    await service.stop(grace=0)


async def status_of(service: Service, name: str) -> int:
    async with grpc.aio.insecure_channel(service.grpc_address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
    return reply.status


async def test_liveness_stays_serving_while_the_service_reports_not_serving(service):
    await service.set_serving(False)  # what the gateway does while its target is down
    assert await status_of(service, "") == NOT_SERVING
    assert await status_of(service, LIVENESS) == SERVING


async def frozen_past(count: int):
    while gc.get_freeze_count() <= count:
        await asyncio.sleep(0.01)


async def test_a_service_keeps_what_it_built_before_serving_out_of_garbage_collection():
    built_at_startup = [[token] for token in range(1000)]  # a warm corpus, say
    frozen_before = gc.get_freeze_count()  # whatever this test process froze already
    serving = asyncio.create_task(serve_until_signalled(Service("test", [], "127.0.0.1:0", None,
                                                                CollectorRegistry()), grace=0))
    try:
        await asyncio.wait_for(frozen_past(frozen_before), timeout=10)
        assert not any(tracked is built_at_startup for tracked in gc.get_objects())  # what collections walk
    finally:
        os.kill(os.getpid(), signal.SIGTERM)
        await serving
        gc.unfreeze()
