"""One request through the real gateway, timed chunk by chunk on the client side."""
from __future__ import annotations

import time

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
                         speculative=common_pb2.SpeculativeConfig(method=method))


async def timed_request(client: SpecdClient, prompt: Prompt, method: str, temperature: float, seed: int | None,
                        max_tokens: int, timeout_s: float) -> RequestRecord:
    """Never raises for a failed RPC: the record carries the error, so a load run can count it."""
    record = RequestRecord(method, prompt.prompt_id, prompt.category, temperature, seed, max_tokens)
    request = make_request(prompt, method, temperature, seed, max_tokens)
    text, last = [], None
    start = time.perf_counter()
    try:
        async for chunk in client.generate(request, timeout=timeout_s):
            now = time.perf_counter() - start
            if chunk.token_ids:
                record.chunks.append((now, len(chunk.token_ids)))
                record.token_ids.extend(chunk.token_ids)
            text.append(chunk.text)
            last = chunk
    except grpc.aio.AioRpcError as err:
        record.error = f"{err.code().name}: {err.details()}"
    record.e2e_s = time.perf_counter() - start
    record.text = "".join(text)
    if record.error is None:
        record.error = _check_final(last, record)
    return record


def _check_final(last, record: RequestRecord) -> str | None:
    """Fill usage from the last chunk; an inconsistent stream is an error, not a data point."""
    if last is None or not last.finish_reason:
        return "stream ended without a finish reason"
    usage = last.usage
    record.finish_reason = FINISH_REASON_NAMES.get(last.finish_reason, "unspecified")
    record.prompt_tokens = usage.prompt_tokens
    record.verification_steps = usage.verification_steps
    record.draft_tokens = usage.draft_tokens
    record.accepted_draft_tokens = usage.accepted_draft_tokens
    if usage.completion_tokens != record.completion_tokens:
        return (f"usage reports {usage.completion_tokens} completion tokens, "
                f"the stream carried {record.completion_tokens}")
    return None
