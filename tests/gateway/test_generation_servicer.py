"""The Generation service end to end: a real gateway in front of a real target with the real model."""
import asyncio
import time
import urllib.request

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.server import create_service
from specd.model_store import DEFAULT_MODEL
from specd.v1 import common_pb2, generation_pb2, generation_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="package")]

GREEDY = common_pb2.SamplingParams(max_tokens=24)
PROMPT = "The three primary colors are"


@pytest_asyncio.fixture(scope="package", loop_scope="package")
async def gateway(target, no_speculation):
    service = await create_service(DEFAULT_MODEL, target.grpc_address, address="127.0.0.1:0",
                                   metrics_address="127.0.0.1:0", default_speculative=no_speculation)
    await service.start()
    yield service
    await service.stop(grace=0)


async def generate(gateway, **fields) -> list[generation_pb2.GenerateResponse]:
    async with grpc.aio.insecure_channel(gateway.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return [response async for response in stub.Generate(generation_pb2.GenerateRequest(**fields))]


async def generate_error(gateway, **fields) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await generate(gateway, **fields)
    return error.value


def token_ids_of(responses) -> list[int]:
    return [token_id for response in responses for token_id in response.token_ids]


def text_of(responses) -> str:
    return "".join(response.text for response in responses)


async def eventually(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def eventually_async(call, condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition(await call()):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True


def aborted_on_target(target) -> float:
    return target.metrics.registry.get_sample_value("specd_requests_finished_total", {"reason": "aborted"}) or 0


def target_dropped_one_more(target, aborted_before: float):
    """Whether the target has aborted another sequence (freeing its KV blocks) and runs none."""
    return lambda: (aborted_on_target(target) == aborted_before + 1
                    and target.metrics.registry.get_sample_value("specd_requests_running") == 0)


async def test_a_prompt_streams_text_deltas_that_join_to_the_decoded_tokens(gateway, tokenizer):
    responses = await generate(gateway, prompt=PROMPT, sampling=GREEDY)
    assert text_of(responses) == tokenizer.decode(token_ids_of(responses))
    assert len(token_ids_of(responses)) == 24


async def test_only_the_last_chunk_carries_finish_reason_and_usage(gateway, tokenizer):
    *chunks, last = await generate(gateway, prompt=PROMPT, sampling=GREEDY)
    assert all(not chunk.finish_reason and not chunk.HasField("usage") for chunk in chunks)
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert last.usage.prompt_tokens == len(tokenizer.encode_prompt(PROMPT))
    assert last.usage.completion_tokens == 24


async def test_a_chat_is_answered_in_the_assistant_turn(gateway):
    messages = [generation_pb2.ChatMessage(role="user", content="What is the capital of France?")]
    responses = await generate(gateway, chat=generation_pb2.ChatMessages(messages=messages), sampling=GREEDY)
    assert "Paris" in text_of(responses)
    assert responses[-1].finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)


async def test_a_stop_string_ends_the_stream_before_it_and_frees_the_target_sequence(gateway, target):
    full_text = text_of(await generate(gateway, prompt=PROMPT, sampling=GREEDY))
    stop = full_text[len(full_text) // 2:][:4]
    aborted_before = aborted_on_target(target)
    responses = await generate(gateway, prompt=PROMPT, sampling=GREEDY, stop=[stop])
    assert text_of(responses) == full_text[:full_text.index(stop)]
    last = responses[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_STOP_STRING
    assert last.usage.completion_tokens == len(token_ids_of(responses)) < 24
    assert await eventually(target_dropped_one_more(target, aborted_before))


async def test_a_client_cancel_cancels_the_target_call(gateway, target):
    aborted_before = aborted_on_target(target)
    async with grpc.aio.insecure_channel(gateway.grpc_address) as channel:
        call = generation_pb2_grpc.GenerationStub(channel).Generate(
            generation_pb2.GenerateRequest(prompt=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=1000)))
        await call.read()
        await call.read()
        call.cancel()
    assert await eventually(target_dropped_one_more(target, aborted_before))
    assert await eventually(lambda: gateway.metrics.registry.get_sample_value("specd_gateway_requests_running") == 0)


async def test_a_request_error_is_invalid_argument_naming_the_field(gateway):
    messages = [generation_pb2.ChatMessage(role="robot", content="beep")]
    error = await generate_error(gateway, chat=generation_pb2.ChatMessages(messages=messages))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("chat.messages[0].role:")


async def test_a_prompt_longer_than_the_context_is_refused(gateway):
    error = await generate_error(gateway, prompt="hello " * 9000)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tokens, the context holds 8192" in error.details()


async def test_a_prompt_that_cannot_fit_whatever_it_tokenizes_to_is_refused_before_tokenizing(gateway):
    started = time.monotonic()
    error = await generate_error(gateway, prompt="x" * 4_000_000)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("prompt: too long: 4000000 characters")
    assert time.monotonic() - started < 5  # tokenizing 4 MB took ~3 s before the check came first


@pytest.mark.parametrize("fields, field", [
    (dict(prompt=PROMPT, request_id="r" * 2_500_000), "request_id"),
    (dict(prompt=PROMPT, stop=["s" * 5000]), "stop[0]"),
    (dict(chat=generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role="user", content="hi")] * 5000)),
     "chat.messages"),
    (dict(prompt=PROMPT, sampling=common_pb2.SamplingParams(temperature=float("inf"))), "sampling.temperature"),
])
async def test_every_size_and_value_is_bounded(gateway, fields, field):
    error = await generate_error(gateway, **fields)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith(f"{field}:")


async def test_a_prompt_that_is_not_utf8_is_invalid_argument_naming_it(gateway):
    async with grpc.aio.insecure_channel(gateway.grpc_address) as channel:
        generate_raw = channel.unary_stream("/specd.v1.Generation/Generate")
        with pytest.raises(grpc.aio.AioRpcError) as error:
            async for _ in generate_raw(b"\x0a\x04ok \xff"):  # GenerateRequest.prompt, with a byte UTF-8 never has
                pass
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details() == "prompt: not valid UTF-8"


async def test_the_gateway_bounds_how_long_a_request_runs_and_the_target_frees_it(target, no_speculation):
    gateway = await create_service(DEFAULT_MODEL, target.grpc_address, address="127.0.0.1:0",
                                   metrics_address=None, default_speculative=no_speculation, upstream_timeout_s=0.5)
    await gateway.start()
    aborted_before = aborted_on_target(target)
    try:
        error = await generate_error(gateway, prompt=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=1000))
    finally:
        await gateway.stop(grace=0)
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert await eventually(target_dropped_one_more(target, aborted_before))


async def test_the_target_status_is_passed_through(gateway):
    # The whole context needs more KV cache than the test target has: the target answers RESOURCE_EXHAUSTED.
    error = await generate_error(gateway, prompt=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=8000))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "KV cache" in error.details()
    handled = gateway.metrics.registry.get_sample_value(
        "specd_rpc_requests_total", {"rpc_method": "Generate", "code": "RESOURCE_EXHAUSTED"})
    assert handled == 1


async def test_a_target_gone_away_is_unavailable_and_the_gateway_reports_not_serving(make_target, no_speculation):
    target = make_target()
    await target.start()
    gateway = await create_service(DEFAULT_MODEL, target.grpc_address, address="127.0.0.1:0",
                                   metrics_address=None, default_speculative=no_speculation)
    await gateway.start()
    await target.stop(grace=0)
    try:
        error = await generate_error(gateway, prompt=PROMPT, sampling=GREEDY)
        async with grpc.aio.insecure_channel(gateway.grpc_address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            not_serving = await eventually_async(
                lambda: health.Check(health_pb2.HealthCheckRequest()),
                lambda reply: reply.status == health_pb2.HealthCheckResponse.NOT_SERVING)
    finally:
        await gateway.stop(grace=0)
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error.details().startswith("target service unavailable:")
    assert not_serving


async def test_metrics_are_served_on_the_gateway_registry(gateway):
    await generate(gateway, prompt=PROMPT, sampling=GREEDY)
    url = f"http://127.0.0.1:{gateway.metrics_port}/metrics"
    scrape = (await asyncio.to_thread(lambda: urllib.request.urlopen(url).read())).decode()
    for sample in ('specd_gateway_requests_finished_total{reason="length"}',
                   "specd_gateway_time_to_first_token_seconds_count",
                   "specd_gateway_inter_token_latency_seconds_count",
                   "specd_gateway_e2e_request_latency_seconds_count",
                   "specd_gateway_prompt_tokens_total",
                   "specd_gateway_completion_tokens_total",
                   "specd_gateway_requests_running",
                   'specd_rpc_requests_total{code="OK",rpc_method="Generate"}'):
        assert sample in scrape
