"""A new drafter is one file and one registry line: here the file is this test, and the drafter is
served end to end through a real drafter service and a real target (tiny model) on loopback."""
import grpc
import pytest

from drafter_svc.proposers.base import DraftRequest
from drafter_svc.proposers.registry import PROPOSERS, register
from drafter_svc.sequences import SequenceState
from drafter_svc.server import create_service as create_drafter
from specd.drafts import DraftTree
from specd.options import Option, OptionSchema, options_to_pb
from specd.types import SpeculativeConfig
from specd.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_svc.server import TargetOptions, TargetService

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]


class RepeatLastToken:
    """Guesses that the last token repeats; its one option says how sure to be."""

    schema = OptionSchema("repeat-last", (Option("confidence", "float", 0.5, minimum=0.0, maximum=1.0),))

    def propose(self, batch: list[DraftRequest]) -> list[DraftTree]:
        return [DraftTree.chain([r.sequence.tokens[-1]] * r.max_tokens, [r.options["confidence"]] * r.max_tokens)
                for r in batch]

    def release(self, sequence: SequenceState) -> None:
        pass


@pytest.fixture
def registered():
    register(RepeatLastToken)  # the one line a new drafter adds to drafter_svc/proposers/registry.py
    yield
    del PROPOSERS["repeat-last"]


@pytest.fixture
async def stub(registered, tiny_model_dir):
    drafter = create_drafter(method="repeat-last", address="127.0.0.1:0", metrics_address=None)
    await drafter.start()
    target = TargetService(TargetOptions(
        model=str(tiny_model_dir), address="127.0.0.1:0", metrics_address=None, kv_cache_tokens=2048,
        drafters={"repeat-last": drafter.grpc_address}, default_speculative=SpeculativeConfig(method="repeat-last"),
        drafter_timeout_s=5.0))  # its drafts are what is checked: a busy machine must not time them out
    await target.start()
    async with grpc.aio.insecure_channel(target.grpc_address) as channel:
        yield target_pb2_grpc.TargetStub(channel)
    await target.stop(0)
    await drafter.stop(0)


async def generate(stub, method: str, **options):
    request = target_pb2.TargetGenerateRequest(
        prompt_token_ids=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=24),
        speculative=common_pb2.SpeculativeConfig(method=method, options=options_to_pb(options)))
    chunks = [chunk async for chunk in stub.Generate(request)]
    return [t for c in chunks for t in c.token_ids], chunks[-1].usage


async def test_a_drafter_defined_outside_the_package_is_served_losslessly(stub):
    plain, _ = await generate(stub, "none")
    drafted, usage = await generate(stub, "repeat-last", confidence=0.9)
    assert drafted == plain
    assert usage.draft_tokens > 0  # its drafts were really verified


async def test_its_options_are_checked_by_its_own_declaration(stub):
    info = await stub.GetModelInfo(target_pb2.ModelInfoRequest())
    assert "repeat-last" in info.methods
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await generate(stub, "repeat-last", confidence=2.0)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith("speculative.options.confidence:")
