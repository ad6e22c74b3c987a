"""The server bootstrap every service shares: what its grpc.health.v1 reports."""
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from specd.serving import LIVENESS, NOT_SERVING, SERVING, Service


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
