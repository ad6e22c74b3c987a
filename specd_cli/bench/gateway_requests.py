"""One request through the real gateway, timed chunk by chunk on the client side, over either of its
APIs: gRPC (`GrpcGateway`) or the OpenAI-compatible HTTP one (`HttpGateway`). Both give the same
RequestRecord: a benchmark compares methods, and can compare the protocols too."""
from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator

import grpc

from specd.client import SpecdClient, build_request
from specd.types import FINISH_REASON_NAMES, SamplingParams
from specd.v1 import common_pb2
from specd_cli.bench.prompts import Prompt
from specd_cli.bench.records import RequestRecord


def make_request(prompt: Prompt, method: str, temperature: float, seed: int | None, max_tokens: int):
    # Only the method is set: every other speculative setting is the deployment's default, as for a user.
    sampling = SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens)
    return build_request(messages=prompt.messages, sampling=sampling,
                         speculative=common_pb2.SpeculativeConfig(method=method, corpus_scope=corpus_scope(method)))


def corpus_scope(method: str) -> str:
    """Each method's requests in a scope of their own: in one scope, the drafters that learn across requests
    would draft a method's answer to a prompt from another method's answer to the same prompt (measured:
    3-6x the tokens a step)."""
    return f"bench-{method}"


class GrpcGateway:
    """The gateway's gRPC Generation API, through `client`."""

    def __init__(self, client: SpecdClient):
        self._client = client

    async def timed_request(self, prompt: Prompt, method: str, temperature: float, seed: int | None,
                            max_tokens: int, timeout_s: float) -> RequestRecord:
        """Never raises for a failed request: the record carries the error, so a load run can count it."""
        record = RequestRecord(method, prompt.prompt_id, prompt.category, temperature, seed, max_tokens)
        request = make_request(prompt, method, temperature, seed, max_tokens)
        text, last = [], None
        start = time.perf_counter()
        try:
            async for chunk in self._client.generate(request, timeout=timeout_s):
                _add_chunk(record, time.perf_counter() - start, chunk.token_ids)
                text.append(chunk.text)
                last = chunk
        except grpc.aio.AioRpcError as err:
            record.error = f"{err.code().name}: {err.details()}"
        record.e2e_s = time.perf_counter() - start
        record.text = "".join(text)
        if record.error is None:
            record.error = ("stream ended without a finish reason" if last is None or not last.finish_reason else
                            _finish(record, FINISH_REASON_NAMES.get(last.finish_reason, "unspecified"),
                                    last.usage.prompt_tokens, last.usage.completion_tokens,
                                    last.usage.verification_steps, last.usage.draft_tokens,
                                    last.usage.accepted_draft_tokens))
        return record


class HttpGateway:
    """The gateway's OpenAI-compatible API at `base_url` (e.g. http://127.0.0.1:8000/v1): streamed chat
    completions with usage, and vLLM's `return_token_ids` so each chunk's tokens are counted exactly."""

    def __init__(self, base_url: str):
        import httpx  # the bench's own dependency; the gRPC route needs none

        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=None)
        self._model: str | None = None

    async def timed_request(self, prompt: Prompt, method: str, temperature: float, seed: int | None,
                            max_tokens: int, timeout_s: float) -> RequestRecord:
        """Never raises for a failed request: the record carries the error, so a load run can count it."""
        import httpx

        record = RequestRecord(method, prompt.prompt_id, prompt.category, temperature, seed, max_tokens)
        body = {"model": await self._served_model(), "messages": prompt.messages, "temperature": temperature,
                "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True,
                "speculative_config": {"method": method, "corpus_scope": corpus_scope(method)}}
        if seed is not None:
            body["seed"] = seed
        text, finish, usage = [], None, None
        start = time.perf_counter()
        try:
            async with self._http.stream("POST", "/chat/completions", json=body, timeout=timeout_s) as response:
                if response.status_code != 200:
                    record.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}"
                else:
                    finish, usage = await _read_events(response, record, text, start)
        except httpx.HTTPError as err:
            record.error = f"{type(err).__name__}: {err}"
        record.e2e_s = time.perf_counter() - start
        record.text = "".join(text)
        if record.error is None:
            record.error = ("stream ended without a finish reason and usage" if finish is None or usage is None else
                            _finish(record, finish, usage["prompt_tokens"], usage["completion_tokens"],
                                    usage["verification_steps"], usage["draft_tokens"],
                                    usage["accepted_draft_tokens"]))
        return record

    async def _served_model(self) -> str:
        if self._model is None:
            response = await self._http.get("/models")
            response.raise_for_status()
            self._model = response.json()["data"][0]["id"]
        return self._model

    async def close(self) -> None:
        await self._http.aclose()


Gateway = GrpcGateway | HttpGateway
PROTOCOLS = ("grpc", "http")


@contextlib.asynccontextmanager
async def connected(protocol: str, address: str) -> AsyncIterator[Gateway]:
    """The gateway at `address` (host:port for gRPC, the API's base URL for HTTP), closed on exit."""
    if protocol == "http":
        gateway = HttpGateway(address)
        try:
            yield gateway
        finally:
            await gateway.close()
        return
    async with SpecdClient(address) as client:
        yield GrpcGateway(client)


async def _read_events(response, record: RequestRecord, text: list[str],
                       start: float) -> tuple[str | None, dict | None]:
    """A chat completion's server-sent events into `record` and `text`: its finish reason and usage (None
    if none came); an error event is the record's error."""
    finish, usage = None, None
    async for line in response.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: "):])
        if "error" in event:
            record.error = f"{event['error']['code']}: {event['error']['message']}"
            break
        usage = event.get("usage") or usage
        for choice in event["choices"]:
            _add_chunk(record, time.perf_counter() - start, choice.get("token_ids", []))
            text.append(choice["delta"].get("content") or "")
            finish = choice["finish_reason"] or finish
    return finish, usage


def _add_chunk(record: RequestRecord, seconds: float, token_ids) -> None:
    if token_ids:
        record.chunks.append((seconds, len(token_ids)))
        record.token_ids.extend(token_ids)


def _finish(record: RequestRecord, finish_reason: str, prompt_tokens: int, completion_tokens: int,
            verification_steps: int, draft_tokens: int, accepted_draft_tokens: int) -> str | None:
    """Fill the record from the request's usage; an inconsistent stream is an error, not a data point."""
    record.finish_reason = finish_reason
    record.prompt_tokens = prompt_tokens
    record.verification_steps = verification_steps
    record.draft_tokens = draft_tokens
    record.accepted_draft_tokens = accepted_draft_tokens
    if completion_tokens != record.completion_tokens:
        return f"usage reports {completion_tokens} completion tokens, the stream carried {record.completion_tokens}"
    return None
