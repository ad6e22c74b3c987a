"""Runs the HTTP app with uvicorn inside the gateway's own event loop, beside its gRPC server."""
from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn
from fastapi import FastAPI

from gateway.http.api_key import ApiKeyCheck
from gateway.http.body_limit import BodySizeLimit
from specd.security import TlsConfig


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its own signal handlers: the gateway's process handles SIGTERM for both APIs."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpServer:
    """The app on `address`, over TLS with `tls`'s certificate, refusing /v1 requests without `api_key`
    when there is one."""

    def __init__(self, app: FastAPI, address: str, tls: TlsConfig | None = None, api_key: str | None = None):
        self._app = app
        self._address = address
        self._tls = tls
        self._api_key = api_key
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task | None = None
        self.port: int | None = None

    async def start(self) -> None:
        # The socket is bound here, not by uvicorn, so a taken port is an error we report (uvicorn exits).
        host, _, port = self._address.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            sock = socket.create_server((host, int(port)), family=family)
        except OSError as error:
            raise RuntimeError(f"gateway HTTP: cannot listen on {self._address}: {error}") from error
        self.port = sock.getsockname()[1]
        app = BodySizeLimit(self._app)
        if self._api_key:  # outermost: a request without the key is refused before anything else
            app = ApiKeyCheck(app, self._api_key)
        tls = dict(ssl_certfile=self._tls.cert_file, ssl_keyfile=self._tls.key_file) if self._tls else {}
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", **tls)
        self._server = _EmbeddedServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError(f"gateway HTTP: the server on {self._address} stopped at start-up")
            await asyncio.sleep(0.01)

    @property
    def url(self) -> str:
        host = self._address.rpartition(":")[0] or "127.0.0.1"
        return f"{'https' if self._tls else 'http'}://{host}:{self.port}"

    async def stop(self, grace: float) -> None:
        """Refuse new connections; in-flight streams get `grace` seconds."""
        if self._server is None:
            return
        self._server.config.timeout_graceful_shutdown = grace  # what uvicorn's shutdown waits, read there
        self._server.should_exit = True
        await self._task
