"""Errors as OpenAI's API reports them: an HTTP status and {"error": {message, type, param, code}},
with the field named as the HTTP request names it (`temperature`, not `sampling.temperature`)."""
from __future__ import annotations

import json

import grpc
from fastapi.responses import JSONResponse

from gateway.pipeline import UpstreamError
from specd.errors import InvalidArgument
from specd.rpc import status_of

HTTP_STATUS_OF = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPE_OF = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                 429: "rate_limit_error"}

# specd's field paths (gRPC API) -> OpenAI's, by prefix; the longest prefix first.
_FIELD_PREFIXES = (("speculative.options", "speculative_config"), ("speculative.", "speculative_config."),
                   ("chat.messages", "messages"), ("sampling.", ""))


def http_field(field: str) -> str:
    for specd_prefix, http_prefix in _FIELD_PREFIXES:
        if field.startswith(specd_prefix):
            return http_prefix + field[len(specd_prefix):]
    return field


class HttpError(Exception):
    """An error to answer with: status, message, the field at fault (None when no one field is)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    @classmethod
    def of(cls, error: Exception) -> HttpError:
        """The HTTP error of anything the pipeline raises; None-status errors are bugs (500)."""
        if isinstance(error, InvalidArgument):
            param = http_field(error.field)
            return cls(400, f"{param}: {error.reason}", param)
        if isinstance(error, UpstreamError):
            field, sep, reason = error.details.partition(": ")
            if error.code == grpc.StatusCode.INVALID_ARGUMENT and sep and " " not in field:
                return cls(400, f"{http_field(field)}: {reason}", http_field(field))
            return cls(HTTP_STATUS_OF.get(error.code, 500), error.details)
        code = status_of(error)
        if code is None:
            raise error
        return cls(HTTP_STATUS_OF.get(code, 500), str(error))

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPE_OF.get(self.status, "server_error"),
                          "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    async def send(self, send) -> None:
        """Answer with this error straight over ASGI, from a middleware in front of the app."""
        body = json.dumps(self.body()).encode()
        await send({"type": "http.response.start", "status": self.status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
