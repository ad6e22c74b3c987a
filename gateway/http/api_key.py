"""The gateway's API key over HTTP, as OpenAI's clients send it (`Authorization: Bearer <key>`): every
route under /v1 refuses a request without it, before its body is read; /health answers anyone."""
from __future__ import annotations

from gateway.http.errors import HttpError
from specd.security import key_matches

PROTECTED_PREFIX = "/v1/"


class ApiKeyCheck:
    """ASGI middleware around the whole app."""

    def __init__(self, app, api_key: str):
        self._app = app
        self._api_key = api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIX):
            authorization = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if not key_matches(authorization, self._api_key):
                await HttpError(401, "authorization: a missing or wrong API key; send the header "
                                     "'Authorization: Bearer <key>'", "authorization").send(send)
                return
        await self._app(scope, receive, send)
