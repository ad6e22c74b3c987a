"""Watching a service another one depends on, through its grpc.health.v1 Check."""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)


class UpstreamHealth:
    """Asks an upstream service "are you serving?" every `interval_s`. A reply other than SERVING,
    an error, or no reply within `timeout_s` (a frozen process keeps its connections open) counts
    as down; `on_change(serving)` is awaited at every change."""

    def __init__(self, name: str, channel: grpc.aio.Channel, on_change: Callable[[bool], Awaitable[None]],
                 interval_s: float = 1.0, timeout_s: float = 2.0):
        self.name = name
        self.serving = True  # started right after the upstream answered
        self.last_problem = ""
        self._stub = health_pb2_grpc.HealthStub(channel)
        self._on_change = on_change
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _watch(self) -> None:
        while True:
            problem = await self._check()
            if (not problem) != self.serving:
                self.serving, self.last_problem = not problem, problem
                log.warning("%s is %s", self.name, "serving again" if self.serving else f"down: {problem}")
                await self._on_change(self.serving)
            await asyncio.sleep(self._interval_s)

    async def _check(self) -> str:
        """Why the upstream is not serving; "" when it is."""
        try:
            reply = await self._stub.Check(health_pb2.HealthCheckRequest(), timeout=self._timeout_s)
        except grpc.aio.AioRpcError as error:
            return f"{error.code().name} {error.details() or ''}".strip()
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return ""
