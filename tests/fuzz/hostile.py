"""What a hostile client sends (hypothesis strategies for every field kind, and raw bytes) and what every
service must answer it: OK, or a clear status that names the field; and then serve the next request."""
from __future__ import annotations

import re

import grpc
from google.protobuf import struct_pb2
from google.protobuf.descriptor import Descriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import strategies as st

from specd.rpc import CHANNEL_OPTIONS
from specd.v1 import common_pb2

VOCAB_SIZE = 49152  # the tiny model's (the default model's)
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1

# What a request may end with besides OK: each tells the client what to change. Never UNKNOWN or INTERNAL
# (a bug), nor UNAVAILABLE (the service or one behind it went down).
CLEAR_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE,
               grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND}

# Sizes around the bounds of specd.limits and of gRPC's 16 MiB message bound.
SIZES = st.one_of(st.integers(0, 8), st.sampled_from([64, 65, 256, 257, 1024, 1025, 4096, 4097, 131073, 262145]))


def mostly(valid: st.SearchStrategy, hostile: st.SearchStrategy) -> st.SearchStrategy:
    """`valid` nine times in ten, else `hostile`: a request with one bad field among good ones gets past the
    first checks to those behind them. (Shrinks toward the valid side.)"""
    return st.integers(0, 9).flatmap(lambda n: hostile if n == 9 else valid)


def int32s() -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from([0, 1, -1, 2, 20, 21, 64, 65, VOCAB_SIZE - 1, VOCAB_SIZE, INT32_MAX, INT32_MIN]),
                     st.integers(INT32_MIN, INT32_MAX))


def small_or_hostile_ints(most: int) -> st.SearchStrategy[int]:
    """Mostly ordinary values, else any int32."""
    return mostly(st.integers(0, most), int32s())


def float32s() -> st.SearchStrategy[float]:
    return st.one_of(st.sampled_from([0.0, -0.0, 1.0, 0.5, 1e-5, 1e-6, 1e-38, 1e-45, 3.4e38, float("nan"),
                                      float("inf"), float("-inf")]),
                     st.floats(width=32))


def uint64s() -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from([0, 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))


def texts(max_size: int = 40) -> st.SearchStrategy[str]:
    """Short text of any code points, special tokens and control characters, or a long run of one."""
    odd = st.sampled_from(["", " ", "\x00", "\n", "\u202e", "\ufeff", "\U0010ffff", "<|im_start|>", "<|im_end|>",
                           "<|endoftext|>", "{{ raise_exception('x') }}", "{% for %}", "\u0301" * 8, "🙂"])
    long = st.tuples(st.sampled_from(["a", "é", "🙂", "<|im_end|>"]), SIZES).map(lambda t: t[0] * t[1])
    return st.one_of(st.text(max_size=max_size), odd, long)


def token_id_lists(most: int = 64) -> st.SearchStrategy[list[int]]:
    """Mostly token ids of the vocabulary (a few of them, so that lookups find repeats), else some outside it
    or a long run of one."""
    valid = st.lists(st.integers(0, 20), max_size=most)
    hostile = st.one_of(st.lists(st.one_of(st.integers(0, VOCAB_SIZE - 1), int32s()), max_size=most),
                        st.tuples(st.integers(0, VOCAB_SIZE - 1), SIZES).map(lambda t: [t[0]] * t[1]))
    return mostly(valid, hostile)


def option_structs(names: list[str]) -> st.SearchStrategy[struct_pb2.Struct]:
    """Speculative options: mostly known names with small whole numbers, else any names with values of every
    JSON kind (NaN, infinities and nesting included), sometimes more of them than are allowed."""
    string = st.one_of(st.text(max_size=64), st.just("x" * 65))  # up to just past the bound of names and values
    scalar = st.one_of(st.none(), st.booleans(), st.floats(), st.integers(-2**60, 2**60).map(float), string)
    value = st.recursive(scalar, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(string, inner, max_size=3)), max_leaves=6)
    valid = st.dictionaries(st.sampled_from(names), st.integers(1, 6).map(float))
    hostile = st.dictionaries(st.one_of(st.sampled_from(names), string), value, max_size=34)

    def to_struct(options: dict) -> struct_pb2.Struct:
        pb = struct_pb2.Struct()
        pb.update(options)
        return pb
    return mostly(valid, hostile).map(to_struct)


METHOD_NAMES = ["", "none", "ngram", "auto", "fused", "lookahead", "eagle", "NGRAM", " ngram"]
OPTION_NAMES = ["prompt_lookup_min", "prompt_lookup_max", "level", "window"]


@st.composite
def sampling_params(draw) -> common_pb2.SamplingParams:
    """Every field mostly in range, else anything its type holds: greedy and sampled requests, and extremes
    (a temperature of 1e-38, a repetition penalty of 3e38, top_p of 1e-45) that stress the arithmetic."""
    temperature = mostly(st.sampled_from([0.0, 0.7, 1.0]), float32s())
    pb = common_pb2.SamplingParams(
        temperature=draw(temperature), top_p=draw(mostly(st.sampled_from([0.0, 0.9, 1.0]), float32s())),
        top_k=draw(mostly(st.sampled_from([0, 1, 50]), int32s())),
        repetition_penalty=draw(mostly(st.sampled_from([0.0, 1.0, 1.3]), float32s())),
        max_tokens=draw(small_or_hostile_ints(6)))
    if draw(st.booleans()):
        pb.seed = draw(uint64s())
    if draw(st.booleans()):
        pb.logprobs = draw(small_or_hostile_ints(20))
    return pb


@st.composite
def speculative_configs(draw) -> common_pb2.SpeculativeConfig:
    pb = common_pb2.SpeculativeConfig(method=draw(mostly(st.sampled_from(METHOD_NAMES), texts())))
    if draw(st.booleans()):
        pb.num_speculative_tokens = draw(small_or_hostile_ints(64))
    if draw(st.booleans()):
        pb.options.CopyFrom(draw(option_structs(OPTION_NAMES)))
    return pb


@st.composite
def mangled(draw, messages: st.SearchStrategy) -> bytes:
    """The bytes of a drawn message with a few bytes flipped, cut or inserted: they still parse as far as
    the damage, so they reach further than random bytes do."""
    raw = bytearray(draw(messages).SerializeToString())
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(raw)))
        edit = draw(st.sampled_from(["flip", "cut", "insert"]))
        if edit == "flip" and at < len(raw):
            raw[at] ^= draw(st.integers(1, 255))
        elif edit == "cut":
            del raw[at:at + draw(st.integers(1, 8))]
        else:
            raw[at:at] = draw(st.binary(min_size=1, max_size=6))
    return bytes(raw)


def raw_requests(messages: st.SearchStrategy) -> st.SearchStrategy[bytes]:
    """Bytes a generic client sends as a request: random, a damaged real request, or one over 16 MiB."""
    oversized = st.just(b"\x0a\x84\x80\x80\x08" + b"a" * (16 * 2**20 + 4))  # field 1, 16 MiB + 4 bytes
    return st.one_of(st.binary(max_size=64), mangled(messages), oversized)


def channel_to(address: str) -> grpc.Channel:
    """A synchronous channel that sends more than a service takes, so the service's own bound answers."""
    return grpc.insecure_channel(address, options=[*CHANNEL_OPTIONS, ("grpc.max_send_message_length", 64 * 2**20)])


def send_raw(channel: grpc.Channel, path: str, kind: str, raw: bytes) -> None:
    """Call a method of any kind with bytes as they are (none of the client's serialization), reading a
    few answers of a stream; raises the call's grpc.RpcError."""
    call = getattr(channel, kind)(path, request_serializer=None, response_deserializer=None)
    if kind == "stream_stream":
        read_some(call(iter([raw])))
    elif kind == "unary_stream":
        read_some(call(raw))
    else:
        call(raw)


def assert_raw_answered_or_refused(channel: grpc.Channel, path: str, kind: str, request: Descriptor,
                                   raw: bytes) -> None:
    """`raw` sent to the method at `path` (of `kind`, taking `request`): answered, or refused clearly."""
    try:
        send_raw(channel, path, kind, raw)
    except grpc.RpcError as error:
        assert_clear(error, request, raw=True)


def assert_clear(error: grpc.RpcError, request: Descriptor, raw: bool = False) -> None:
    """`error` is a status the client can act on; an INVALID_ARGUMENT names the field of `request` at fault
    ("field.path: reason"), or, for bytes that are no such message at all, says so."""
    code, details = error.code(), error.details() or ""
    assert code in CLEAR_CODES, f"{code.name}: {details}"
    if code != grpc.StatusCode.INVALID_ARGUMENT:
        return
    if raw and details == f"the request is not a valid {request.full_name} message":
        return
    named = re.match(r"([a-z_]+)(\[\d+\])?[.:]", details)
    assert named and named.group(1) in request.fields_by_name, f"no field of {request.full_name} named: {details}"


def read_some(responses, most: int = 3) -> list:
    """Up to `most` messages of a response stream; then it is cancelled (its sequence freed) if still going."""
    read = []
    for response in responses:
        read.append(response)
        if len(read) == most:
            responses.cancel()
            break
    return read


def assert_serving(channel: grpc.Channel, service_name: str) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", service_name):
        status = health.Check(health_pb2.HealthCheckRequest(service=name)).status
        assert status == health_pb2.HealthCheckResponse.SERVING, f"{name or 'the server'} is not serving"
