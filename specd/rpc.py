"""The gRPC edge every specd service shares: domain errors to status codes, requests that do not
decode, and the options of every server and channel (message sizes, keepalive)."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import time
from typing import Callable

import grpc
from google.protobuf import empty_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet
from prometheus_client import CollectorRegistry, Counter, Histogram

from specd.errors import DeadlineExceeded, InternalError, InvalidArgument, ResourceExhausted, Unavailable
from specd.security import TlsConfig

log = logging.getLogger(__name__)

# One bound for every message in and out: far above the largest legitimate one (a prompt of a
# 128k-token context), far below what would strain a service's memory.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MESSAGE_SIZE_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                         ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
# A peer that stops answering (frozen, or gone without closing the socket) is noticed within
# KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS, and every call on that connection fails UNAVAILABLE.
KEEPALIVE_TIME_MS = 5_000
KEEPALIVE_TIMEOUT_MS = 5_000  # also the ping timeout: without it an unanswered ping waits a minute
CHANNEL_OPTIONS = [*MESSAGE_SIZE_OPTIONS,
                   ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
                   ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
                   ("grpc.keepalive_permit_without_calls", 1),
                   ("grpc.http2.max_pings_without_data", 0),
                   ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
                   # a restarted peer is reconnected to within seconds (gRPC's default back-off grows to 2 min)
                   ("grpc.initial_reconnect_backoff_ms", 500),
                   ("grpc.max_reconnect_backoff_ms", 5_000)]
SERVER_OPTIONS = [*MESSAGE_SIZE_OPTIONS,
                  ("grpc.so_reuseport", 0),
                  # accept the clients' keepalive pings above (the default minimum is 5 minutes)
                  ("grpc.keepalive_permit_without_calls", 1),
                  ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
                  # Clients reconnect once a minute (calls in flight finish first), so they find replicas
                  # added since: a balanced channel re-resolves a headless Service's name only then.
                  ("grpc.max_connection_age_ms", 60_000)]
# Calls go to each address the name resolves to in turn, skipping those whose grpc.health.v1 status
# is not SERVING (a replica shutting down, or one that cannot serve): only when none serves do calls
# fail UNAVAILABLE.
BALANCED_SERVICE_CONFIG = json.dumps({"loadBalancingConfig": [{"round_robin": {}}],
                                      "healthCheckConfig": {"serviceName": ""}})


def service_channel(address: str, tls: TlsConfig | None = None) -> grpc.aio.Channel:
    """A channel to another specd service, with keepalive and the message size bounds; over mutual TLS
    when the calling service has a TLS identity."""
    return _channel(address, tls, CHANNEL_OPTIONS)


def balanced_channel(address: str, tls: TlsConfig | None = None) -> grpc.aio.Channel:
    """A channel to replicas any of which can answer any call, at every address `address` resolves to
    (a headless Service's `dns:///target:50052`, or `ipv4:127.0.0.1:50052,127.0.0.1:50053`): calls are
    spread round-robin over those that are serving."""
    return _channel(address, tls, [*CHANNEL_OPTIONS, ("grpc.service_config", BALANCED_SERVICE_CONFIG)])


def _channel(address: str, tls: TlsConfig | None, options: list) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)


_STATUS_OF = ((InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
              (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
              (Unavailable, grpc.StatusCode.UNAVAILABLE),
              (InternalError, grpc.StatusCode.INTERNAL),
              (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED))


def status_of(error: Exception) -> grpc.StatusCode | None:
    """The status code of a domain error (subclasses included); None for anything else."""
    return next((code for kind, code in _STATUS_OF if isinstance(error, kind)), None)


class RpcMetrics:
    """Handled RPCs by method and status code, and their duration."""

    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter("specd_rpc_requests", "RPCs handled by this service, by method and gRPC status code",
                                ["rpc_method", "code"], registry=registry)
        self.duration = Histogram("specd_rpc_duration_seconds",
                                  "Seconds this service spent on one RPC, a whole stream included",
                                  ["rpc_method"], registry=registry,
                                  buckets=(.001, .005, .01, .05, .1, .5, 1, 2.5, 5, 10, 30, 60, 120))

    def observe(self, method: str, code: grpc.StatusCode, started: float) -> None:
        self.requests.labels(method, code.name).inc()
        self.duration.labels(method).observe(time.perf_counter() - started)


@contextlib.asynccontextmanager
async def _rpc_scope(metrics: RpcMetrics, method: str, context: grpc.aio.ServicerContext):
    """Maps domain errors to gRPC status codes and counts the call by its final code. Anything
    else is a bug: logged with its traceback, and the client sees INTERNAL without internals."""
    started, code = time.perf_counter(), grpc.StatusCode.OK
    try:
        yield
    except asyncio.CancelledError:
        code = grpc.StatusCode.CANCELLED
        raise
    except grpc.aio.AbortError:  # context.abort() was called; the context holds its code
        code = context.code() or grpc.StatusCode.UNKNOWN
        raise
    except Exception as exc:
        code = status_of(exc)
        if code is None:
            log.exception("%s failed", method)
            code, exc = grpc.StatusCode.INTERNAL, "internal error"
        await context.abort(code, str(exc))
    finally:
        metrics.observe(method, code, started)


def rpc_handler(func: Callable) -> Callable:
    """Wrap a servicer method (coroutine or async generator) in `_rpc_scope`, with the
    servicer's `rpc_metrics`."""
    if inspect.isasyncgenfunction(func):
        @functools.wraps(func)
        async def stream_wrapper(self, request, context):
            async with _rpc_scope(self.rpc_metrics, func.__name__, context):
                async for item in func(self, request, context):
                    yield item
        return stream_wrapper

    @functools.wraps(func)
    async def unary_wrapper(self, request, context):
        async with _rpc_scope(self.rpc_metrics, func.__name__, context):
            return await func(self, request, context)
    return unary_wrapper


class _Undecodable:
    """Stands in for a request whose bytes did not parse, so the handler can answer INVALID_ARGUMENT
    (a raising deserializer makes gRPC answer UNKNOWN with Python internals)."""

    def __init__(self, descriptor: Descriptor, raw: bytes):
        field = invalid_utf8_field(descriptor, raw)
        self.message = (f"{field}: not valid UTF-8" if field
                        else f"the request is not a valid {descriptor.full_name} message")


def invalid_utf8_field(descriptor: Descriptor, raw: bytes, prefix: str = "") -> str | None:
    """The path (e.g. `chat.messages[1].content`) of the first string field in `raw` that is not
    UTF-8, walking the wire format; None if there is none."""
    try:
        fields = UnknownFieldSet(empty_pb2.Empty.FromString(raw))  # every field lands here unparsed
    except DecodeError:
        return None
    seen: dict[int, int] = {}
    for wire in fields:
        field = descriptor.fields_by_number.get(wire.field_number)
        if field is None or wire.wire_type != 2:  # 2: length-delimited (strings, messages)
            continue
        index = seen[wire.field_number] = seen.get(wire.field_number, -1) + 1
        path = prefix + field.name + (f"[{index}]" if field.is_repeated else "")
        if field.type == FieldDescriptor.TYPE_STRING:
            try:
                wire.data.decode("utf-8")
            except UnicodeDecodeError:
                return path
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            found = invalid_utf8_field(field.message_type, wire.data, path + ".")
            if found:
                return found
    return None


class UndecodableRequestInterceptor(grpc.aio.ServerInterceptor):
    """Answers a request that does not parse (e.g. a string field that is not UTF-8) with
    INVALID_ARGUMENT naming the field, for every method of the server (in a request stream, the
    message that does not parse ends the stream so). Each method's handler is wrapped once, not per
    call (the drafter's Propose runs every decoding step)."""

    def __init__(self):
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}  # only methods the server has: bounded

    async def intercept_service(self, continuation, handler_call_details):
        wrapped = self._wrapped.get(handler_call_details.method)
        if wrapped is None:
            handler = await continuation(handler_call_details)
            if handler is None:
                return None
            wrapped = self._wrapped[handler_call_details.method] = _answering_undecodable(handler)
        return wrapped


def _answering_undecodable(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    if handler.request_deserializer is None:
        return handler
    parse = handler.request_deserializer
    message_class = getattr(parse, "__self__", None)  # generated stubs pass the class's FromString
    if message_class is None:
        return handler
    descriptor = message_class.DESCRIPTOR

    def deserialize(raw: bytes):
        try:
            return parse(raw)
        except DecodeError:
            return _Undecodable(descriptor, raw)

    if handler.request_streaming:
        if not handler.response_streaming:  # no specd service takes a stream for one answer
            return handler
        behavior = handler.stream_stream

        async def stream_stream(requests, context):
            async def decoded():
                async for request in requests:
                    if isinstance(request, _Undecodable):
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                    yield request
            async for response in behavior(decoded(), context):
                yield response
        return handler._replace(request_deserializer=deserialize, stream_stream=stream_stream)

    if handler.response_streaming:
        behavior = handler.unary_stream

        async def unary_stream(request, context):
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            responses = behavior(request, context)
            if inspect.isasyncgen(responses):
                async for response in responses:
                    yield response
            else:  # a handler that streams with context.write() (the health service's Watch)
                await responses
        return handler._replace(request_deserializer=deserialize, unary_stream=unary_stream)

    behavior = handler.unary_unary

    async def unary_unary(request, context):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await behavior(request, context)
    return handler._replace(request_deserializer=deserialize, unary_unary=unary_unary)
