"""The soak's load: clients that each send their next request as soon as the last one ends, until told to
stop; and the cancel storm: many streams at once, each cancelled as soon as its first tokens arrive."""
from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, field

import grpc

from specd.client import SpecdClient
from specd.v1 import generation_pb2
from specd_cli.soak.request_mix import RequestMix

# Long enough that a storm's stream is still generating when it is cancelled.
STORM_MAX_TOKENS = 512


@dataclass
class Outcomes:
    completed: int = 0
    cancelled: int = 0  # by the soak itself, on purpose: the storm's streams
    lost: Counter[str] = field(default_factory=Counter)  # every other ending, by gRPC status code or what was wrong

    @property
    def lost_total(self) -> int:
        return sum(self.lost.values())


async def run_client(client: SpecdClient, mix: RequestMix, rng: random.Random, outcomes: Outcomes,
                     stop: asyncio.Event, timeout_s: float | None) -> None:
    """Requests back to back until `stop` is set; the one in flight then is let finish."""
    while not stop.is_set():
        try:
            _, token_ids, last = await client.complete(mix.draw(rng), timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            outcomes.lost[err.code().name] += 1
            continue
        if problem := _problem_with(last, len(token_ids)):
            outcomes.lost[problem] += 1
        else:
            outcomes.completed += 1


async def cancel_storm(client: SpecdClient, mix: RequestMix, rng: random.Random, streams: int, outcomes: Outcomes,
                       timeout_s: float | None) -> None:
    """`streams` streams at once, each cancelled by the client once its first tokens have arrived."""
    await asyncio.gather(*(_cancel_after_first_tokens(client, mix.draw(rng, STORM_MAX_TOKENS), outcomes, timeout_s)
                           for _ in range(streams)))


async def _cancel_after_first_tokens(client: SpecdClient, request: generation_pb2.GenerateRequest,
                                     outcomes: Outcomes, timeout_s: float | None) -> None:
    call = client.generate(request, timeout=timeout_s)
    try:
        while (chunk := await call.read()) is not grpc.aio.EOF:
            if chunk.finish_reason:  # done before any chunk with tokens: nothing left to cancel
                outcomes.completed += 1
                return
            if chunk.token_ids:
                call.cancel()
                outcomes.cancelled += 1
                return
    except grpc.aio.AioRpcError as err:
        outcomes.lost[err.code().name] += 1
        return
    outcomes.lost["ENDED_WITHOUT_FINISH_REASON"] += 1


def _problem_with(last: generation_pb2.GenerateResponse | None, tokens_streamed: int) -> str | None:
    """What is wrong with a stream that ended without an error status, if anything."""
    if last is None or not last.finish_reason:
        return "ENDED_WITHOUT_FINISH_REASON"
    if last.usage.completion_tokens != tokens_streamed:
        return "USAGE_DISAGREES_WITH_STREAM"
    return None
