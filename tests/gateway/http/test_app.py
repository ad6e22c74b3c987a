"""The OpenAI-compatible HTTP API, driven by the official `openai` client (and raw HTTP where the
client hides what is on the wire), through a real gateway in front of a real target with the real model."""
import asyncio
import json

import grpc
import httpx
import openai
import pytest
import pytest_asyncio

from gateway.server import create_service
from specd.model_store import DEFAULT_MODEL
from specd.v1 import common_pb2, generation_pb2, generation_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="package")]

MESSAGES = [{"role": "user", "content": "Name three primary colors."}]
GREEDY = {"temperature": 0, "max_tokens": 24}


@pytest_asyncio.fixture(scope="package", loop_scope="package")
async def gateway(target, no_speculation):
    service = await create_service(DEFAULT_MODEL, target.grpc_address, address="127.0.0.1:0",
                                   metrics_address="127.0.0.1:0", default_speculative=no_speculation,
                                   http_address="127.0.0.1:0")
    await service.start()
    yield service
    await service.stop(grace=0)


@pytest_asyncio.fixture(loop_scope="package")
async def client(gateway):
    async with openai.AsyncOpenAI(base_url=f"{gateway.http.url}/v1", api_key="unused", max_retries=0) as client:
        yield client


async def grpc_text(gateway, **fields) -> str:
    async with grpc.aio.insecure_channel(gateway.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return "".join([r.text async for r in stub.Generate(generation_pb2.GenerateRequest(**fields))])


async def test_models_lists_the_served_model(client):
    models = await client.models.list()
    assert [model.id for model in models.data] == [DEFAULT_MODEL]


async def test_health_is_ok_while_the_target_serves(gateway):
    async with httpx.AsyncClient() as http:
        response = await http.get(f"{gateway.http.url}/health")
    assert response.status_code == 200


async def test_a_chat_completion_is_the_text_the_grpc_api_gives(gateway, client):
    completion = await client.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, **GREEDY)
    chat = generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(**m) for m in MESSAGES])
    expected = await grpc_text(gateway, chat=chat, sampling=common_pb2.SamplingParams(max_tokens=24))
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected
    assert choice.finish_reason in ("stop", "length")
    assert completion.usage.completion_tokens <= 24
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens


async def test_a_streamed_chat_joins_to_the_whole_completion_and_ends_with_usage(client):
    whole = await client.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, **GREEDY)
    stream = await client.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, stream=True,
                                                  stream_options={"include_usage": True}, **GREEDY)
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


async def test_a_completion_continues_the_prompt_as_the_grpc_api_does(gateway, client):
    prompt = "The three primary colors are"
    completion = await client.completions.create(model=DEFAULT_MODEL, prompt=prompt, **GREEDY)
    expected = await grpc_text(gateway, prompt=prompt, sampling=common_pb2.SamplingParams(max_tokens=24))
    assert completion.choices[0].text == expected
    stream = await client.completions.create(model=DEFAULT_MODEL, prompt=prompt, stream=True, **GREEDY)
    assert "".join([chunk.choices[0].text async for chunk in stream]) == expected


async def test_stop_strings_and_seeded_sampling_follow_the_request(client):
    fields = {"model": DEFAULT_MODEL, "messages": MESSAGES, "max_tokens": 24, "temperature": 1.0, "seed": 7}
    first = await client.chat.completions.create(**fields)
    again = await client.chat.completions.create(**fields)
    assert first.choices[0].message.content == again.choices[0].message.content
    text = first.choices[0].message.content
    cut = await client.chat.completions.create(**fields, stop=[text[5:8]])
    assert cut.choices[0].message.content == text[:text.index(text[5:8])]
    assert cut.choices[0].finish_reason == "stop"


async def test_a_bad_value_is_a_400_naming_the_field_as_the_http_api_names_it(client):
    with pytest.raises(openai.BadRequestError) as error:
        await client.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, temperature=-1)
    assert error.value.body["param"] == "temperature"
    assert "temperature" in error.value.message


@pytest.mark.parametrize("fields, param", [
    ({"n": 2}, "n"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"extra_body": {"speculative_config": {"method": "medusa"}}}, "speculative_config.method"),
])
async def test_what_specd_cannot_honour_is_refused_by_name(client, fields, param):
    with pytest.raises(openai.BadRequestError) as error:
        await client.chat.completions.create(**{"model": DEFAULT_MODEL, "messages": MESSAGES, **fields})
    assert error.value.body["param"] == param


async def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="gpt-4o", messages=MESSAGES)


async def test_a_request_too_big_for_the_kv_cache_is_a_429(client):
    with pytest.raises(openai.RateLimitError) as error:
        await client.completions.create(model=DEFAULT_MODEL, prompt="Hi", max_tokens=8000)
    assert "KV" in error.value.message or "kv" in error.value.message


async def test_a_body_that_is_not_json_is_a_400_in_openai_error_form(gateway):
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{gateway.http.url}/v1/chat/completions", content=b"{not json",
                                   headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


async def test_a_client_that_leaves_mid_stream_frees_its_sequence_at_the_target(gateway, target):
    def running():
        return target.metrics.registry.get_sample_value("specd_requests_running")

    body = {"model": DEFAULT_MODEL, "messages": MESSAGES, "max_tokens": 2000, "temperature": 0, "stream": True}
    async with httpx.AsyncClient() as http:
        async with http.stream("POST", f"{gateway.http.url}/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    assert json.loads(line[6:])["object"] == "chat.completion.chunk"
                    break
    for _ in range(100):
        if running() == 0:
            break
        await asyncio.sleep(0.05)
    assert running() == 0


async def test_return_token_ids_gives_each_chunk_the_ids_the_grpc_api_streams(gateway, client):
    stream = await client.completions.create(model=DEFAULT_MODEL, prompt="Once upon a time", stream=True,
                                             extra_body={"return_token_ids": True}, **GREEDY)
    streamed = [token_id async for chunk in stream for token_id in chunk.choices[0].model_extra["token_ids"]]
    async with grpc.aio.insecure_channel(gateway.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = generation_pb2.GenerateRequest(prompt="Once upon a time",
                                                 sampling=common_pb2.SamplingParams(max_tokens=24))
        expected = [token_id async for r in stub.Generate(request) for token_id in r.token_ids]
    assert streamed == expected and len(expected) == 24


async def test_chat_logprobs_name_each_token_with_its_top_alternatives(client):
    completion = await client.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, logprobs=True,
                                                      top_logprobs=3, **GREEDY)
    content = completion.choices[0].logprobs.content
    assert len(content) == completion.usage.completion_tokens
    assert "".join(entry.token for entry in content).startswith(completion.choices[0].message.content)
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].token == entry.token  # greedy: the likeliest token is the one emitted
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


async def test_streamed_completion_logprobs_are_the_whole_ones_chunk_by_chunk(client):
    fields = {"model": DEFAULT_MODEL, "prompt": "The three primary colors are", "logprobs": 2, **GREEDY}
    whole = (await client.completions.create(**fields)).choices[0].logprobs
    stream = await client.completions.create(**fields, stream=True)
    streamed = [chunk.choices[0].logprobs async for chunk in stream]
    assert [t for lp in streamed if lp for t in lp.tokens] == whole.tokens
    assert [x for lp in streamed if lp for x in lp.token_logprobs] == pytest.approx(whole.token_logprobs)
    assert all(len(top) <= 2 for top in whole.top_logprobs)


@pytest.mark.parametrize("length_header, status", [(f"Content-Length: {64 * 1024 * 1024}", 413),
                                                   ("Transfer-Encoding: chunked", 411)])
async def test_a_body_too_large_or_of_undeclared_length_is_refused_before_it_is_read(gateway, length_header,
                                                                                     status):
    # Raw HTTP: a client library will not declare a length it does not send.
    port = gateway.http.url.rpartition(":")[2]
    reader, writer = await asyncio.open_connection("127.0.0.1", int(port))
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"{length_header}\r\n\r\n{{".encode())
    await writer.drain()
    head, _, body = (await asyncio.wait_for(reader.read(65536), 10)).partition(b"\r\n\r\n")
    writer.close()
    assert head.split()[1] == str(status).encode()
    assert json.loads(body)["error"]["message"].startswith("body: ")
    async with httpx.AsyncClient() as http:  # and the server goes on
        assert (await http.get(f"{gateway.http.url}/v1/models")).status_code == 200
