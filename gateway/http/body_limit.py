"""A bound on request bodies, checked before a byte of one is read: uvicorn and FastAPI read a body
whole, however large. A body must declare its length (JSON clients do); beyond MAX_HTTP_BODY_BYTES,
or undeclared (chunked), the request is refused in OpenAI's error form."""
from __future__ import annotations

from gateway.http.errors import HttpError
from specd.limits import MAX_HTTP_BODY_BYTES


class BodySizeLimit:
    """ASGI middleware around the whole app."""

    def __init__(self, app, max_bytes: int = MAX_HTTP_BODY_BYTES):
        self._app = app
        self._max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] in ("POST", "PUT", "PATCH"):
            error = self._refusal(dict(scope["headers"]).get(b"content-length"))
            if error is not None:
                await error.send(send)
                return
        await self._app(scope, receive, send)

    def _refusal(self, declared: bytes | None) -> HttpError | None:
        if declared is None:
            return HttpError(411, "body: send Content-Length (a body of undeclared length is not read)")
        if not declared.isdigit() or int(declared) > self._max_bytes:
            return HttpError(413, f"body: at most {self._max_bytes} bytes, got {declared.decode(errors='replace')}")
        return None

