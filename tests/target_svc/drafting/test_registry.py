"""A proposer that runs inside the target is one file and one registry line: here the file is this
test, and the proposer is served end to end by a real target (tiny model) on loopback."""
import grpc
import pytest

from specd.drafts import DraftTree
from specd.options import OptionSchema
from specd.types import SpeculativeConfig
from specd.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_svc.drafting.registry import IN_TARGET_SOURCES, register
from target_svc.sequence import Sequence
from target_svc.server import TargetOptions, TargetService

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]


class EchoPrompt:
    """Guesses that the text goes on as the prompt began."""

    method = "echo-prompt"
    schema = OptionSchema(method)

    async def start(self) -> None:
        pass

    async def propose(self, wanted: list[tuple[Sequence, int]]) -> dict[str, DraftTree]:
        return {seq.request_id: DraftTree.chain(seq.prompt[:k], [0.8] * min(k, len(seq.prompt))) for seq, k in wanted}

    def release(self, sequence: Sequence) -> None:
        pass

    async def close(self) -> None:
        pass


@pytest.fixture
async def stub(tiny_model_dir):
    register(EchoPrompt.method, EchoPrompt)  # the one line a new in-target proposer adds to the registry
    target = TargetService(TargetOptions(
        model=str(tiny_model_dir), address="127.0.0.1:0", metrics_address=None, kv_cache_tokens=2048,
        drafters={"echo-prompt": None}, default_speculative=SpeculativeConfig(method="echo-prompt")))
    await target.start()
    async with grpc.aio.insecure_channel(target.grpc_address) as channel:
        yield target_pb2_grpc.TargetStub(channel)
    await target.stop(0)
    del IN_TARGET_SOURCES[EchoPrompt.method]


async def generate(stub, method: str):
    request = target_pb2.TargetGenerateRequest(prompt_token_ids=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=24),
                                               speculative=common_pb2.SpeculativeConfig(method=method))
    chunks = [chunk async for chunk in stub.Generate(request)]
    return [t for c in chunks for t in c.token_ids], chunks[-1].usage


async def test_an_in_target_proposer_is_served_losslessly(stub):
    plain, _ = await generate(stub, "none")
    drafted, usage = await generate(stub, "echo-prompt")
    assert drafted == plain
    assert usage.draft_tokens > 0
