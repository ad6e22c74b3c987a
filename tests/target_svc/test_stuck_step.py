"""A target stuck inside a step (its compute thread deadlocked, the process otherwise alive), as its clients
and the health checks see it: directly and through a gateway, on a tiny random model."""
import asyncio
import threading
import time

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.server import create_service
from specd.model_store import DEFAULT_MODEL
from specd.types import SpeculativeConfig
from specd.v1 import common_pb2, generation_pb2, generation_pb2_grpc, target_pb2, target_pb2_grpc
from target_svc.server import TargetOptions, TargetService

pytestmark = pytest.mark.asyncio(loop_scope="module")

STEP_TIMEOUT_S = 1.0
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7]
NO_SPECULATION = SpeculativeConfig(method="none")
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class StuckForward:
    """The runner's forward; once told to `stick`, its calls from the third on block until released, as on a
    deadlocked compute thread (the first ones prefill and decode, so streams are stuck mid-way)."""

    def __init__(self, forward):
        self._forward, self._calls = forward, 0
        self.release = threading.Event()
        self.release.set()
        self.stuck_at: float | None = None  # when the first call blocked

    def stick(self) -> None:
        self._calls = 0
        self.release.clear()

    def __call__(self, inputs):
        self._calls += 1
        if self._calls >= 3 and not self.release.is_set():
            self.stuck_at = self.stuck_at or time.monotonic()
            self.release.wait()
        return self._forward(inputs)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def target(tiny_model_dir):
    service = TargetService(TargetOptions(model=str(tiny_model_dir), address="127.0.0.1:0", metrics_address=None,
                                          kv_cache_tokens=2048, default_speculative=NO_SPECULATION,
                                          step_timeout_s=STEP_TIMEOUT_S))
    await service.start()
    yield service
    await service.stop(0)


@pytest.fixture
def stuck(target, monkeypatch):
    """Installed on the target's runner; released at the end whatever happened, so the target can stop."""
    forward = StuckForward(target.runner.forward)
    monkeypatch.setattr(target.runner, "forward", forward)
    yield forward
    forward.release.set()


@pytest_asyncio.fixture(loop_scope="module")
async def gateway(target):
    service = await create_service(DEFAULT_MODEL, target.grpc_address, address="127.0.0.1:0", metrics_address=None,
                                   default_speculative=NO_SPECULATION)
    await service.start()
    yield service
    await service.stop(0)


def request(max_tokens=40) -> target_pb2.TargetGenerateRequest:
    return target_pb2.TargetGenerateRequest(prompt_token_ids=PROMPT,
                                            sampling=common_pb2.SamplingParams(max_tokens=max_tokens))


async def tokens_until_error(call) -> tuple[list[int], grpc.aio.AioRpcError]:
    """The tokens a stream yielded before it failed, and how it failed."""
    tokens = []
    with pytest.raises(grpc.aio.AioRpcError) as error:
        async for chunk in call:
            tokens.extend(chunk.token_ids)
    return tokens, error.value


async def health_is(address: str, status: int, timeout_s: float = 10.0) -> bool:
    """True once the server at `address` reports `status`, polling until timeout_s."""
    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status != status:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.1)
    return True


def sample(target, name: str, labels: dict[str, str] | None = None) -> float | None:
    return target.metrics.registry.get_sample_value(name, labels)


async def test_a_stuck_step_fails_the_streams_waiting_on_it_deadline_exceeded_and_health_says_not_serving(
        target, stuck):
    """Clients with no deadline of their own are not left hanging; new requests are refused while the step is
    stuck; once it ends the target serves again, its output and its KV cache as before."""
    stuck_before = sample(target, "specd_stuck_steps_total")
    failed_before = sample(target, "specd_requests_finished_total", {"reason": "stuck"}) or 0.0
    async with grpc.aio.insecure_channel(target.grpc_address) as channel:
        stub = target_pb2_grpc.TargetStub(channel)
        plain = [t async for chunk in stub.Generate(request()) for t in chunk.token_ids]
        stuck.stick()
        failures = await asyncio.gather(*(tokens_until_error(stub.Generate(request())) for _ in range(2)))
        failed_after = time.monotonic() - stuck.stuck_at
        not_serving = await health_is(target.grpc_address, NOT_SERVING)
        stuck_gauge = sample(target, "specd_step_stuck")
        _, refused = await tokens_until_error(stub.Generate(request()))
        stuck.release.set()
        serving_again = await health_is(target.grpc_address, SERVING)
        after = [t async for chunk in stub.Generate(request()) for t in chunk.token_ids]
    print(f"stuck -> DEADLINE_EXCEEDED in {failed_after:.2f} s (--step-timeout {STEP_TIMEOUT_S:g} s)")
    assert [error.code() for _, error in failures] == [grpc.StatusCode.DEADLINE_EXCEEDED] * 2
    assert all("did not answer in time" in error.details() for _, error in failures)
    assert any(tokens for tokens, _ in failures)  # failed mid-stream
    assert STEP_TIMEOUT_S * 0.9 < failed_after < STEP_TIMEOUT_S + 5
    assert not_serving and stuck_gauge == 1
    assert refused.code() == grpc.StatusCode.UNAVAILABLE and "stuck" in refused.details()
    assert serving_again and after == plain
    assert sample(target, "specd_step_stuck") == 0 and sample(target, "specd_stuck_steps_total") == stuck_before + 1
    assert sample(target, "specd_requests_finished_total", {"reason": "stuck"}) == failed_before + 2
    allocator = target.runner.allocator
    assert allocator.num_free_blocks == allocator.num_blocks


async def test_through_the_gateway_a_client_without_a_deadline_hears_the_target_did_not_answer_in_time(
        target, gateway, stuck):
    """The gateway passes the target's DEADLINE_EXCEEDED on with its reason, reports NOT_SERVING while the
    target does, and serves again after."""
    generate = generation_pb2.GenerateRequest(prompt="The three primary colors are",
                                              sampling=common_pb2.SamplingParams(max_tokens=40))
    async with grpc.aio.insecure_channel(gateway.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        stuck.stick()
        tokens, error = await tokens_until_error(stub.Generate(generate))
        failed_after = time.monotonic() - stuck.stuck_at
        not_serving = await health_is(gateway.grpc_address, NOT_SERVING)
        not_serving_after = time.monotonic() - stuck.stuck_at
        stuck.release.set()
        serving_again = await health_is(gateway.grpc_address, SERVING)
        after = [response async for response in stub.Generate(generate)]
    print(f"stuck -> DEADLINE_EXCEEDED through the gateway in {failed_after:.2f} s, "
          f"its health NOT_SERVING in {not_serving_after:.2f} s")
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and tokens
    assert error.details().startswith("the target did not answer in time")
    assert failed_after < STEP_TIMEOUT_S + 5
    assert not_serving and serving_again
    assert after[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
