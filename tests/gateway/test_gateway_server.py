import grpc
import pytest

from gateway.server import create_service, fetch_model_info
from specd.model_store import DEFAULT_MODEL
from specd.ports import free_ports
from specd.errors import InvalidArgument
from specd.types import SpeculativeConfig
from specd.v1 import target_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="package")


async def test_waiting_for_a_target_that_never_comes_up_gives_up_naming_it():
    address = f"127.0.0.1:{free_ports(1)[0]}"
    async with grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(RuntimeError, match=f"target at {address} did not answer GetModelInfo within 0.5 s"):
            await fetch_model_info(target_pb2_grpc.TargetStub(channel), address, timeout_s=0.5)


@pytest.mark.e2e
async def test_the_model_info_of_a_running_target_is_fetched(target):
    async with grpc.aio.insecure_channel(target.grpc_address) as channel:
        info = await fetch_model_info(target_pb2_grpc.TargetStub(channel), target.grpc_address, timeout_s=5)
    assert info.max_context_length == 8192
    assert "none" in info.methods


@pytest.mark.e2e
async def test_a_default_method_the_target_does_not_serve_fails_at_startup(target):
    with pytest.raises(InvalidArgument, match="speculative.method"):
        await create_service(DEFAULT_MODEL, target.grpc_address, address="127.0.0.1:0", metrics_address=None,
                             default_speculative=SpeculativeConfig(method="eagle"))
