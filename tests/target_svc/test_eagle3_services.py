"""An EAGLE-3 head as its authors publish them, served by a real eagle drafter service beside a real target:
the drafter names the three target layers it drafts from, the target sends their features with each update,
the head drafts from them, and the greedy output is the target's alone."""
import grpc
import pytest

from drafter_svc.server import create_service as create_drafter
from specd.types import SpeculativeConfig
from specd.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_svc.server import TargetOptions, TargetService
from tests.eagle3_reference import write_published_eagle3_head

PROMPT = [5, 6, 7, 8, 9] * 8  # 40 tokens: three prefill chunks of at most 16


@pytest.fixture
async def stub(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("target_svc.drafting.gate.TYPICAL_EVIDENCE", 10 ** 9)  # ask the drafter every step
    write_published_eagle3_head(tiny_model_dir, tmp_path, layers=[1, 0, 1], sureness=100.0)
    drafter = create_drafter(method="eagle", address="127.0.0.1:0", metrics_address=None,
                             proposer_args={"head": str(tmp_path), "model": str(tiny_model_dir)})
    await drafter.start()
    target = TargetService(TargetOptions(
        model=str(tiny_model_dir), address="127.0.0.1:0", metrics_address=None, kv_cache_tokens=2048,
        max_num_seqs=4, max_step_tokens=16, drafter_timeout_s=5.0, drafters={"eagle": drafter.grpc_address},
        default_speculative=SpeculativeConfig(method="eagle", num_speculative_tokens=3)))
    try:
        await target.start()
        async with grpc.aio.insecure_channel(target.grpc_address) as channel:
            yield target_pb2_grpc.TargetStub(channel)
        await target.stop(0)
    finally:
        await drafter.stop(0)


async def generate(stub, method):
    request = target_pb2.TargetGenerateRequest(
        request_id=f"r-{method}", prompt_token_ids=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=24),
        speculative=common_pb2.SpeculativeConfig(method=method))
    chunks = [chunk async for chunk in stub.Generate(request)]
    return [t for c in chunks for t in c.token_ids], chunks[-1].usage


async def test_an_eagle3_head_drafts_from_the_targets_layers_and_the_output_is_the_targets(stub):
    expected, _ = await generate(stub, "none")
    output, usage = await generate(stub, "eagle")
    assert output == expected
    assert usage.draft_tokens > 0  # the features of the layers it named reached the head, which drafted from them
