"""Domain errors every service raises; `specd.rpc` maps each to a gRPC status code at the edge."""
from __future__ import annotations


class InvalidArgument(ValueError):
    """A request field is out of range; becomes gRPC INVALID_ARGUMENT naming the field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.reason = message


class ResourceExhausted(RuntimeError):
    """The server cannot take this request now (queue full, KV cache too small)."""


class Unavailable(RuntimeError):
    """A service this request needs is down right now; the client may retry."""


def check_length(field_name: str, value, most: int, unit: str = "items") -> None:
    """Every size on the API is bounded: `value` (a str, bytes or list) holds at most `most` units."""
    if len(value) > most:
        raise InvalidArgument(field_name, f"at most {most} {unit}, got {len(value)}")


class InternalError(RuntimeError):
    """Something failed inside the server for this request only; its message is safe to show."""


class DeadlineExceeded(RuntimeError):
    """The server could not answer in time (the target stuck in a step); its message is safe to show."""
