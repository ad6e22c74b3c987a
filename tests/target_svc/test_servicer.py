"""The target service through a real gRPC server on loopback, on a tiny random model."""
import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drafter_svc.server import create_service as create_drafter
from specd.limits import MAX_REQUEST_ID_CHARS
from specd.types import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from specd.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_svc.server import TargetOptions, TargetService

REPETITIVE_PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]


@pytest.fixture
async def drafter():
    service = create_drafter(address="127.0.0.1:0", metrics_address=None)
    await service.start()
    yield service
    await service.stop(0)


@pytest.fixture
async def target(tiny_model_dir, drafter):
    service = TargetService(TargetOptions(
        model=str(tiny_model_dir), address="127.0.0.1:0", metrics_address=None,
        drafters={"ngram": drafter.grpc_address}, kv_cache_tokens=2048, default_max_tokens=32,
        drafter_timeout_s=5.0,  # drafts are what these tests check: a busy machine must not time them out
        default_speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=8, options={"prompt_lookup_min": 1})))
    await service.start()
    yield service
    await service.stop(0)


@pytest.fixture
async def stub(target):
    async with grpc.aio.insecure_channel(target.grpc_address) as channel:
        yield target_pb2_grpc.TargetStub(channel)


def _request(prompt=REPETITIVE_PROMPT, method="ngram", max_tokens=24, **sampling):
    return target_pb2.TargetGenerateRequest(
        prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=max_tokens, **sampling),
        speculative=common_pb2.SpeculativeConfig(method=method))


async def _generate(stub, request):
    chunks = [c async for c in stub.Generate(request)]
    return [t for c in chunks for t in c.token_ids], chunks


async def test_greedy_output_with_ngram_drafts_equals_output_without(stub):
    plain, _ = await _generate(stub, _request(method="none"))
    speculative, chunks = await _generate(stub, _request(method="ngram"))
    assert speculative == plain
    assert chunks[-1].usage.draft_tokens > 0  # the drafter really proposed


async def test_last_chunk_carries_finish_reason_and_usage(stub):
    tokens, chunks = await _generate(stub, _request(max_tokens=5))
    last = chunks[-1]
    assert all(c.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
    assert last.finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP)
    assert last.usage.prompt_tokens == len(REPETITIVE_PROMPT)
    assert last.usage.completion_tokens == len(tokens) <= 5
    assert last.usage.verification_steps == len(chunks) - 1  # every chunk after the prefill's
    assert last.usage.accepted_draft_tokens == sum(c.accepted_draft_tokens for c in chunks)


async def test_concurrent_requests_get_the_same_tokens_as_alone(stub):
    prompts = [REPETITIVE_PROMPT, [1, 2, 3, 4], list(range(40, 90))]
    alone = [(await _generate(stub, _request(p)))[0] for p in prompts]
    together = await asyncio.gather(*(_generate(stub, _request(p)) for p in prompts))
    assert [t for t, _ in together] == alone


async def test_a_step_that_raises_for_one_of_several_streams_fails_that_stream_alone(stub, target, monkeypatch):
    """Under load: once one sequence has decoded a few tokens, every forward it is in raises. Its client gets
    INTERNAL with a reason and no Python internals; the others get what they get without the fault; every KV
    block comes back."""
    prompts = [REPETITIVE_PROMPT, [1, 2, 3, 4], list(range(40, 90)), list(range(100, 130))]
    poisoned = [11, 12, 13, 14, 15]
    alone = [(await _generate(stub, _request(p)))[0] for p in prompts]
    forward, failed_batches = target.runner.forward, []

    def faulty_forward(inputs):
        ids = {s.request_id for s in target.scheduler._running if s.prompt == poisoned}
        if any(i.seq_id in ids and i.start_position > len(poisoned) + 2 for i in inputs):
            failed_batches.append(len(inputs))
            raise RuntimeError("injected fault: CUDA error: device-side assert triggered")
        return forward(inputs)

    monkeypatch.setattr(target.runner, "forward", faulty_forward)

    async def tokens_or_error(prompt):
        tokens = []
        try:
            async for chunk in stub.Generate(_request(prompt)):
                tokens.extend(chunk.token_ids)
        except grpc.aio.AioRpcError as error:
            return tokens, error
        return tokens, None

    *others, (poisoned_tokens, error) = await asyncio.gather(*map(tokens_or_error, [*prompts, poisoned]))
    assert others == [(tokens, None) for tokens in alone]
    assert poisoned_tokens  # it failed mid-stream,
    assert max(failed_batches) > 1  # in a step it shared
    assert error.code() == grpc.StatusCode.INTERNAL
    assert error.details() == "internal error in the decoding step"
    assert target.metrics.registry.get_sample_value("specd_requests_finished_total", {"reason": "error"}) == 1
    assert target.runner.allocator.num_free_blocks == target.runner.allocator.num_blocks


async def test_seeded_sampling_is_reproducible(stub):
    request = _request(temperature=0.8, top_p=0.9, seed=1234)
    first, _ = await _generate(stub, request)
    second, _ = await _generate(stub, request)
    assert first == second


@pytest.mark.parametrize("request_fields, field", [
    (dict(prompt=[]), "prompt_token_ids"),
    (dict(prompt=[10 ** 7]), "prompt_token_ids"),
    (dict(temperature=-1.0), "sampling.temperature"),
    (dict(top_p=1.5), "sampling.top_p"),
    (dict(method="medusa"), "speculative.method"),
])
async def test_bad_input_is_invalid_argument_naming_the_field(stub, request_fields, field):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _generate(stub, _request(**request_fields))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()


async def test_a_request_id_over_the_bound_is_invalid_argument(stub):
    request = _request()
    request.request_id = "x" * (MAX_REQUEST_ID_CHARS + 1)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _generate(stub, request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("request_id:")


async def test_a_temperature_below_the_epsilon_decodes_greedily(stub):
    greedy, _ = await _generate(stub, _request(method="none"))
    tiny, _ = await _generate(stub, _request(method="none", temperature=1e-40))
    assert tiny == greedy


async def test_k_out_of_range_is_invalid_argument(stub):
    request = _request()
    request.speculative.num_speculative_tokens = MAX_SPECULATIVE_TOKENS + 1
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _generate(stub, request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "speculative.num_speculative_tokens" in err.value.details()


async def test_prompt_longer_than_the_context_is_invalid_argument(stub, target):
    too_long = [1] * target.runner.max_context_length
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _generate(stub, _request(prompt=too_long))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_request_bigger_than_the_kv_cache_is_resource_exhausted(stub):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _generate(stub, _request(prompt=list(range(1000)), max_tokens=1500))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_client_cancel_frees_the_sequences_kv_blocks(stub, target):
    allocator = target.runner.allocator
    call = stub.Generate(_request(max_tokens=200, method="none"))
    await call.read()
    assert allocator.num_free_blocks < allocator.num_blocks
    call.cancel()
    for _ in range(100):
        if allocator.num_free_blocks == allocator.num_blocks:
            break
        await asyncio.sleep(0.05)
    assert allocator.num_free_blocks == allocator.num_blocks


async def test_a_dead_drafter_costs_speed_not_the_request(stub, drafter, target):
    plain, _ = await _generate(stub, _request(method="none"))
    await drafter.stop(0)
    tokens, chunks = await _generate(stub, _request(method="ngram"))
    assert tokens == plain
    assert chunks[-1].usage.draft_tokens == 0
    async with grpc.aio.insecure_channel(target.grpc_address) as channel:  # it can do without drafters
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING


async def test_on_shutdown_in_flight_streams_finish_within_the_grace_and_new_ones_are_refused(stub, target):
    call = stub.Generate(_request(method="none", max_tokens=200))
    first = await call.read()
    stopping = asyncio.get_running_loop().create_task(target.stop(grace=30))
    await asyncio.sleep(0.05)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _generate(stub, _request())
    rest = []
    while (chunk := await call.read()) is not grpc.aio.EOF:
        rest.append(chunk)
    await stopping
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 200


async def test_model_info_lists_the_served_methods(stub, target):
    info = await stub.GetModelInfo(target_pb2.ModelInfoRequest())
    assert list(info.methods) == ["none", "ngram", "auto"]
    assert [(m.method, [o.name for o in m.options]) for m in info.method_info] == \
        [("none", []), ("ngram", ["prompt_lookup_min", "prompt_lookup_max"]), ("auto", [])]  # as described
    assert info.max_context_length == target.runner.max_context_length


async def test_logprobs_with_ngram_drafts_are_those_without_for_the_same_tokens(stub):
    """Whichever method drafted a token, its logprob is the target's own at that position."""
    plain_tokens, plain = await _generate(stub, _request(method="none", logprobs=2))
    tokens, speculative = await _generate(stub, _request(method="ngram", logprobs=2))
    assert tokens == plain_tokens and speculative[-1].usage.accepted_draft_tokens > 0
    plain_lps = [lp for chunk in plain for lp in chunk.logprobs]
    lps = [lp for chunk in speculative for lp in chunk.logprobs]
    assert len(lps) == len(plain_lps) == len(tokens)
    assert [lp.logprob for lp in lps] == pytest.approx([lp.logprob for lp in plain_lps], abs=1e-4)
    assert [list(lp.top_token_ids) for lp in lps] == [list(lp.top_token_ids) for lp in plain_lps]
    assert all(lp.top_token_ids[0] == token for lp, token in zip(lps, tokens))  # greedy: the top one


async def test_no_logprobs_unless_asked_and_a_count_past_20_is_refused(stub):
    _, chunks = await _generate(stub, _request(max_tokens=4))
    assert all(not chunk.logprobs for chunk in chunks)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await _generate(stub, _request(logprobs=21))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.logprobs" in error.value.details()
