"""What a client sees when something fails, through the real processes of `specd up` (supervised, so
a service that dies is restarted) on the real model."""
import asyncio
import signal
import threading
import time
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoModelForCausalLM, AutoTokenizer

from specd.client import SpecdClient, build_request
from specd.model_store import resolve_model
from specd.types import SamplingParams
from specd.v1 import common_pb2
from specd_cli.stack import Stack, StackPorts

pytestmark = pytest.mark.e2e

PROMPT = "Repeat after me three times: the quick brown fox jumps over the lazy dog."
LONG_ANSWER = "Write a long story, with many chapters, about a quick brown fox and a lazy dog."


@pytest.fixture(scope="module")
def stack():
    """`specd up` as it runs for a user: every service a process, watched by the supervisor."""
    stack = Stack(ports=StackPorts.free(), threads=2)
    stop = threading.Event()
    supervisor = threading.Thread(target=stack.supervise, args=(stop,))
    try:
        stack.up()
        supervisor.start()
        yield stack
    finally:
        for process in stack.processes.values():
            process.send_signal(signal.SIGCONT)  # nothing stays frozen if a test failed midway
        stop.set()
        if supervisor.is_alive():
            supervisor.join()
        else:
            stack.down()


def chat_request(max_tokens=40, method="ngram", **sampling):
    return build_request(messages=[{"role": "user", "content": PROMPT}],
                         sampling=SamplingParams(max_tokens=max_tokens, **sampling),
                         speculative=common_pb2.SpeculativeConfig(method=method))


async def complete(stack, request, timeout=120):
    async with SpecdClient(stack.address("gateway")) as client:
        return await client.complete(request, timeout=timeout)


async def health_of(stack, service: str) -> int:
    async with grpc.aio.insecure_channel(stack.address(service)) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.aio.AioRpcError:
            return health_pb2.HealthCheckResponse.UNKNOWN
        return reply.status


async def eventually(check, timeout_s: float) -> bool:
    """True once `await check()` is true, polling until timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.2)
    return True


def metric(stack, service: str, name: str) -> float:
    with urllib.request.urlopen(stack.metrics_url(service), timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise KeyError(name)


async def test_a_repetition_penalty_beside_another_stream_is_lossless_and_breaks_nothing(stack):
    _, alone, _ = await complete(stack, chat_request())
    (_, alongside, _), (_, with_drafts, _) = await asyncio.gather(
        complete(stack, chat_request()), complete(stack, chat_request(repetition_penalty=1.3)))
    _, without_drafts, _ = await complete(stack, chat_request(method="none", repetition_penalty=1.3))
    model_dir = resolve_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    expected = model.generate(ids, max_new_tokens=40, do_sample=False, repetition_penalty=1.3)[0, ids.shape[1]:]
    assert with_drafts == without_drafts == expected.tolist()
    assert alongside == alone


async def test_a_frozen_target_ends_streams_and_requests_and_the_gateway_reports_not_serving(stack):
    target = stack.processes["target"]
    async with SpecdClient(stack.address("gateway")) as client:
        in_flight = client.generate(chat_request(max_tokens=2000, method="none"))  # no deadline of its own
        await in_flight.read()
        target.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as deadline_error:
                await client.complete(chat_request(), timeout=3)
            assert deadline_error.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
            assert time.monotonic() - started < 4.5
            assert await eventually(lambda: _is(stack, "gateway", health_pb2.HealthCheckResponse.NOT_SERVING), 5)
            with pytest.raises(grpc.aio.AioRpcError) as unavailable:  # refused at once while the target is down
                await client.complete(chat_request(), timeout=30)
            assert unavailable.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.aio.AioRpcError) as stream_error:  # keepalive notices the frozen peer
                await asyncio.wait_for(_drain(in_flight), timeout=30)
            assert stream_error.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            target.send_signal(signal.SIGCONT)
    assert await eventually(lambda: _is(stack, "gateway", health_pb2.HealthCheckResponse.SERVING), 30)
    _, tokens, last = await complete(stack, chat_request(max_tokens=8))
    assert len(tokens) == 8 and last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert await eventually(lambda: _value_is(stack, "target", "specd_kv_cache_blocks_used", 0), 10)


async def test_a_release_lost_while_the_drafter_was_frozen_reaches_it_later(stack):
    drafter = stack.processes["drafter-ngram"]
    async with SpecdClient(stack.address("gateway")) as client:
        call = client.generate(chat_request(max_tokens=30), timeout=120)
        await call.read()
        await call.read()  # a decode step has run: the drafter holds the sequence
        drafter.send_signal(signal.SIGSTOP)
        try:
            await _drain(call)  # the rest goes draft-free; its Release times out
            await asyncio.sleep(1.5)
        finally:
            drafter.send_signal(signal.SIGCONT)
    assert await eventually(lambda: _value_is(stack, "drafter-ngram", "specd_drafter_sequences", 0), 20)


async def test_a_frozen_gateway_ends_the_clients_stream_unavailable_and_nothing_stays_held_once_it_thaws(stack):
    """SpecdClient's keepalive notices a gateway that stops answering (a stream with no deadline would
    otherwise wait forever); once the gateway runs again it cancels the orphaned upstream call."""
    gateway = stack.processes["gateway"]
    async with SpecdClient(stack.address("gateway")) as client:
        in_flight = client.generate(chat_request(max_tokens=2000, method="none"))  # no deadline of its own
        await in_flight.read()
        gateway.send_signal(signal.SIGSTOP)
        try:
            frozen = time.monotonic()
            error, ended = await asyncio.wait_for(_failure_of(in_flight), timeout=60)
        finally:
            gateway.send_signal(signal.SIGCONT)
    print(f"gateway frozen -> {error.code().name} in {ended - frozen:.1f} s: {error.details()!r}")
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert ended - frozen < 20  # keepalive: a ping every 5 s, 5 s to answer it
    assert await eventually(lambda: _value_is(stack, "target", "specd_kv_cache_blocks_used", 0), 30)
    _, tokens, _ = await complete(stack, chat_request(max_tokens=8))
    assert len(tokens) == 8


async def test_a_target_killed_mid_stream_ends_every_stream_unavailable_at_once_and_is_restarted(stack):
    """SIGKILL under load: the dead process's sockets close, so every stream ends at once (no keepalive wait),
    UNAVAILABLE naming the target and why (its connection closed); the supervisor restarts the target and the
    stack serves again."""
    dead = stack.processes["target"]
    async with SpecdClient(stack.address("gateway")) as client:
        calls = [client.generate(build_request(messages=[{"role": "user", "content": LONG_ANSWER}],
                                               sampling=SamplingParams(max_tokens=2000),
                                               speculative=common_pb2.SpeculativeConfig(method=method)))
                 for method in ("none", "ngram", "suffix", "none")]  # no deadline of their own
        for call in calls:
            await call.read()
        dead.kill()
        killed = time.monotonic()
        ended = await asyncio.wait_for(asyncio.gather(*map(_failure_of, calls)), timeout=60)
    print(f"killed -> UNAVAILABLE in {[round(at - killed, 2) for _, at in ended]} s: {ended[0][0].details()!r}")
    for error, at in ended:
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert error.details().startswith("target service unavailable:")
        assert at - killed < 5
    assert await eventually(lambda: _is_restarted(stack, dead), 15)
    # The new target loads and profiles its model first: tens of seconds, minutes on a busy machine.
    assert await eventually(lambda: _is(stack, "gateway", health_pb2.HealthCheckResponse.SERVING), 300)
    _, tokens, _ = await complete(stack, chat_request(max_tokens=8))
    assert len(tokens) == 8


async def _drain(call) -> None:
    while await call.read() is not grpc.aio.EOF:
        pass


async def _failure_of(call) -> tuple[grpc.aio.AioRpcError, float]:
    """How and when a stream failed."""
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await _drain(call)
    return error.value, time.monotonic()


async def _is(stack, service: str, status: int) -> bool:
    return await health_of(stack, service) == status


async def _value_is(stack, service: str, name: str, value: float) -> bool:
    return await asyncio.to_thread(metric, stack, service, name) == value


async def _is_restarted(stack, dead) -> bool:
    return stack.processes["target"] is not dead
