"""The gRPC edge every service shares, on a real server on loopback with servicers defined here."""
import asyncio

import grpc
import pytest
from prometheus_client import CollectorRegistry

from specd.errors import InvalidArgument
from specd.rpc import RpcMetrics, balanced_channel, invalid_utf8_field, rpc_handler, service_channel
from specd.serving import Service, ServiceSpec
from specd.v1 import drafter_pb2, drafter_pb2_grpc, generation_pb2, generation_pb2_grpc


class BadSequenceId(InvalidArgument):
    """A subclass of a domain error maps to the same status as the error itself."""


class Misbehaving(drafter_pb2_grpc.DrafterServicer):
    def __init__(self):
        self.rpc_metrics = RpcMetrics(CollectorRegistry())

    @rpc_handler
    async def Propose(self, request, context):
        return {}["a bug"]  # KeyError: an error the servicer did not mean to raise

    @rpc_handler
    async def Release(self, request, context):
        raise BadSequenceId("sequence_ids[0]", "no such sequence")

    @rpc_handler
    async def ProposeStream(self, requests, context):  # answers each request with its sequence ids
        async for request in requests:
            yield drafter_pb2.ProposeResponse(drafts=[drafter_pb2.Draft(sequence_id=u.sequence_id)
                                                      for u in request.sequences])


class Echo(generation_pb2_grpc.GenerationServicer):
    def __init__(self):
        self.rpc_metrics = RpcMetrics(CollectorRegistry())

    @rpc_handler
    async def Generate(self, request, context):
        yield generation_pb2.GenerateResponse(text=request.prompt)


@pytest.fixture
async def service():
    specs = [ServiceSpec(drafter_pb2_grpc.add_DrafterServicer_to_server, Misbehaving(), "specd.v1.Drafter"),
             ServiceSpec(generation_pb2_grpc.add_GenerationServicer_to_server, Echo(), "specd.v1.Generation")]
    service = Service("test", specs, "127.0.0.1:0", None, CollectorRegistry())
    await service.start()
    yield service
    await service.stop(grace=0)


@pytest.fixture
async def channel(service):
    async with service_channel(service.grpc_address) as channel:
        yield channel


async def test_an_unexpected_error_is_internal_without_python_internals(channel):
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await drafter_pb2_grpc.DrafterStub(channel).Propose(drafter_pb2.ProposeRequest())
    assert error.value.code() == grpc.StatusCode.INTERNAL
    assert error.value.details() == "internal error"


async def test_a_subclass_of_a_domain_error_gets_its_status(channel):
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await drafter_pb2_grpc.DrafterStub(channel).Release(drafter_pb2.ReleaseRequest())
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details() == "sequence_ids[0]: no such sequence"


def chat_bytes(*contents: bytes) -> bytes:
    """A serialized GenerateRequest with chat messages whose content bytes are given as is."""
    messages = b""
    for content in contents:
        message = b"\x0a\x04user" + b"\x12" + bytes([len(content)]) + content  # role = 1, content = 2
        messages += b"\x0a" + bytes([len(message)]) + message  # ChatMessages.messages = 1
    return b"\x12" + bytes([len(messages)]) + messages  # GenerateRequest.chat = 2


async def test_a_string_that_is_not_utf8_is_invalid_argument_naming_the_field(channel):
    generate = channel.unary_stream("/specd.v1.Generation/Generate", request_serializer=None,
                                    response_deserializer=generation_pb2.GenerateResponse.FromString)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        async for _ in generate(chat_bytes(b"fine", b"bad \xff\xfe")):
            pass
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details() == "chat.messages[1].content: not valid UTF-8"
    responses = [r async for r in generate(generation_pb2.GenerateRequest(prompt="ok").SerializeToString())]
    assert responses[0].text == "ok"  # valid requests still pass through the same handler


async def test_a_message_that_is_not_utf8_in_a_request_stream_ends_it_as_invalid_argument(channel):
    propose = channel.stream_stream("/specd.v1.Drafter/ProposeStream", request_serializer=None,
                                    response_deserializer=drafter_pb2.ProposeResponse.FromString)
    call = propose()
    fine = drafter_pb2.ProposeRequest(sequences=[drafter_pb2.SequenceUpdate(sequence_id="ok")])
    await call.write(fine.SerializeToString())
    assert (await call.read()).drafts[0].sequence_id == "ok"
    update = b"\x0a\x01\xff"  # SequenceUpdate.sequence_id = 1: one byte, not UTF-8
    await call.write(b"\x0a" + bytes([len(update)]) + update)  # ProposeRequest.sequences = 1
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await call.read()
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details() == "sequences[0].sequence_id: not valid UTF-8"


@pytest.mark.parametrize("raw, field", [
    (b"\x0a\x02\xff\xfe", "prompt"),
    (chat_bytes(b"ok", b"\xc3"), "chat.messages[1].content"),
    (b"\x22\x01\x80", "stop[0]"),
    (generation_pb2.GenerateRequest(prompt="fine", stop=["a"]).SerializeToString(), None),
])
def test_the_first_string_that_is_not_utf8_is_found_by_its_path(raw, field):
    assert invalid_utf8_field(generation_pb2.GenerateRequest.DESCRIPTOR, raw) == field


class Named(generation_pb2_grpc.GenerationServicer):
    """Answers with the name of the replica that took the call."""

    def __init__(self, name: str):
        self.name = name
        self.rpc_metrics = RpcMetrics(CollectorRegistry())

    @rpc_handler
    async def Generate(self, request, context):
        yield generation_pb2.GenerateResponse(text=self.name)


@pytest.fixture
async def replicas():
    replicas = [Service(name, [ServiceSpec(generation_pb2_grpc.add_GenerationServicer_to_server, Named(name),
                                           "specd.v1.Generation")], "127.0.0.1:0", None, CollectorRegistry())
                for name in ("a", "b")]
    for replica in replicas:
        await replica.start()
    yield replicas
    for replica in replicas:
        await replica.stop(grace=0)


async def answering_replicas(channel, calls: int) -> list[str]:
    stub = generation_pb2_grpc.GenerationStub(channel)
    return [response.text for _ in range(calls)
            async for response in stub.Generate(generation_pb2.GenerateRequest(), timeout=5)]


async def both_connected(channel) -> None:
    """Until a replica has connected, calls go to those that have."""
    for _ in range(50):
        if set(await answering_replicas(channel, 2)) == {"a", "b"}:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("a replica never answered")


async def test_a_balanced_channel_spreads_calls_over_every_address_it_resolves_to(replicas):
    address = "ipv4:" + ",".join(f"127.0.0.1:{replica.port}" for replica in replicas)
    async with balanced_channel(address) as channel:
        await both_connected(channel)
        assert sorted(await answering_replicas(channel, 4)) == ["a", "a", "b", "b"]


async def test_a_balanced_channel_skips_a_replica_that_is_not_serving(replicas):
    address = "ipv4:" + ",".join(f"127.0.0.1:{replica.port}" for replica in replicas)
    async with balanced_channel(address) as channel:
        await both_connected(channel)
        await replicas[0].set_serving(False)
        await asyncio.sleep(0.2)  # the health status travels on a stream of its own
        assert await answering_replicas(channel, 4) == ["b"] * 4
        await replicas[1].set_serving(False)
        await asyncio.sleep(0.2)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await answering_replicas(channel, 1)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
