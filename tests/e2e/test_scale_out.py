"""Scale-out on loopback, as deploy/k8s runs it: one gateway in front of two target processes (a
headless Service's addresses, here gRPC's `ipv4:` list), and the two targets sharing one drafter. The
targets run a tiny random-weight model with the default model's vocabulary, so the gateway's tokenizer
pairs with it."""
import asyncio
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from gateway.server import create_service
from specd.client import SpecdClient, build_request
from specd.model_store import DEFAULT_MODEL
from specd.ports import free_ports
from specd.types import SamplingParams, SpeculativeConfig
from specd.v1 import target_pb2, target_pb2_grpc
from specd_cli.stack import wait_serving
from tests.e2e.test_failures import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

STARTUP_TIMEOUT_S = 180.0


@dataclass
class ServiceProcess:
    """`specd serve ROLE` in a child process, on free loopback ports."""
    popen: subprocess.Popen
    address: str
    metrics_url: str

    @classmethod
    def start(cls, role: str, *args: str) -> "ServiceProcess":
        port, metrics_port = free_ports(2)
        command = [sys.executable, "-m", "specd_cli.main", "serve", role, "--listen", f"127.0.0.1:{port}",
                   "--metrics-listen", f"127.0.0.1:{metrics_port}", *args]
        return cls(subprocess.Popen(command), f"127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics")

    def wait_serving(self, deadline: float) -> None:
        wait_serving(self.address, self.address, self.popen, deadline)

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples called `name` whose labels include `labels`."""
        with urllib.request.urlopen(self.metrics_url, timeout=5) as response:
            families = text_string_to_metric_families(response.read().decode())
            return sum(sample.value for family in families for sample in family.samples
                       if sample.name == name and labels.items() <= sample.labels.items())

    def stop(self) -> None:
        self.popen.terminate()  # SIGTERM: a graceful shutdown
        try:
            self.popen.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.popen.kill()


@pytest.fixture(scope="module")
def services(make_tiny_model):
    """One n-gram drafter and two targets that both draft with it."""
    model = make_tiny_model()
    started = []
    try:
        drafter = ServiceProcess.start("drafter", "--method", "ngram")
        started.append(drafter)
        for _ in range(2):
            started.append(ServiceProcess.start("target", "--model", str(model), "--threads", "1",
                                                "--kv-cache-tokens", "4096", "--drafter", f"ngram={drafter.address}"))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for service in started:
            service.wait_serving(deadline)
        yield drafter, started[1:]
    finally:
        for service in started:
            service.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(services):
    """A gateway whose target address resolves to both targets."""
    _, targets = services
    target_address = "ipv4:" + ",".join(target.address for target in targets)
    gateway = await create_service(DEFAULT_MODEL, target_address, address="127.0.0.1:0", metrics_address=None)
    await gateway.start()
    yield gateway
    await gateway.stop(grace=0)


def generate_calls(targets: list[ServiceProcess]) -> list[float]:
    return [target.metric("specd_rpc_requests_total", rpc_method="Generate", code="OK") for target in targets]


async def complete_all(gateway, prompts: list[str]) -> None:
    """Plain decoding: drafts that do not pay (the random model's text) would teach the targets' drafting
    gates to ask the drafter only at rare probes, and the shared-drafter test below counts its asks."""
    async with SpecdClient(gateway.grpc_address) as client:
        await asyncio.gather(*(client.complete(build_request(prompt=prompt, sampling=SamplingParams(max_tokens=8),
                                                             speculative=SpeculativeConfig("none").to_pb()),
                                               timeout=60) for prompt in prompts))


async def test_the_gateway_spreads_requests_over_both_targets(services, gateway):
    _, targets = services
    before = generate_calls(targets)
    await complete_all(gateway, [f"Count to {n}:" for n in range(6)])
    served = [after - start for after, start in zip(generate_calls(targets), before)]
    assert sum(served) == 6
    assert all(count >= 1 for count in served), served


async def generate_on(target: ServiceProcess, request_id: str, prompt: list[int], method: str) -> list[int]:
    request = target_pb2.TargetGenerateRequest(request_id=request_id, prompt_token_ids=prompt,
                                               sampling=SamplingParams(max_tokens=24).to_pb(),
                                               speculative=SpeculativeConfig(method=method).to_pb())
    async with grpc.aio.insecure_channel(target.address) as channel:
        return [token async for chunk in target_pb2_grpc.TargetStub(channel).Generate(request, timeout=60)
                for token in chunk.token_ids]


async def test_two_targets_share_one_drafter_without_mixing_up_their_sequences(services):
    drafter, targets = services
    # Prompts that repeat themselves (n-gram drafts), of different lengths on the two targets, under
    # request ids both targets are given at once: a drafter holding the two as one sequence would find
    # each target's updates starting past what the other left it, and answer resync_needed.
    prompts = {target.address: [1, *range(100 + 40 * i, 100 + 40 * i + 10 + 7 * i)] * 3
               for i, target in enumerate(targets)}
    asks_before = [target.metric("specd_drafter_rpc_seconds_count", method="ngram") for target in targets]
    drafted = await asyncio.gather(*(generate_on(target, f"shared-{n}", prompts[target.address], "ngram")
                                     for n in range(3) for target in targets))
    undrafted = await asyncio.gather(*(generate_on(target, f"shared-{n}", prompts[target.address], "none")
                                       for n in range(3) for target in targets))
    assert drafted == undrafted  # greedy: drafts change the speed, never the tokens
    asks = [target.metric("specd_drafter_rpc_seconds_count", method="ngram") - before
            for target, before in zip(targets, asks_before)]
    assert all(count > 0 for count in asks), asks  # both targets drafted with the one drafter
    assert drafter.metric("specd_drafter_proposals_total") > 0
    assert drafter.metric("specd_drafter_resyncs_total") == 0


async def test_once_a_target_is_gone_the_other_serves_every_request_and_the_gateway_stays_serving(services,
                                                                                                    gateway):
    """Last in this module: it stops the first target."""
    _, (leaving, staying) = services
    leaving.stop()
    before = generate_calls([staying])[0]
    await complete_all(gateway, [f"Name {n} colours:" for n in range(4)])

    async def staying_served_all() -> bool:
        return generate_calls([staying])[0] - before == 4
    # A target counts a stream once its handler has returned, which can be just after the client had the last
    # token (a fresh-clone CI run counted 2 of 4 at once).
    assert await eventually(staying_served_all, timeout_s=10), generate_calls([staying])[0] - before
    async with grpc.aio.insecure_channel(gateway.grpc_address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
