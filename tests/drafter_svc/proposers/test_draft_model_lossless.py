"""draft_model served by a real drafter service to a real target (tiny model, loopback): greedy output is
the output without drafts, and sampled output follows the target's distribution."""
from collections import Counter

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from drafter_svc.server import create_service as create_drafter
from specd.types import SpeculativeConfig
from specd.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_svc.server import TargetOptions, TargetService

PROMPT = [11, 400, 9000, 23, 5, 77, 1024, 3]
TOP_K = 4
SAMPLES = 400


@pytest.fixture(scope="module")
def peaked_model_dir(make_tiny_model):
    """The tiny model with large weights: peaked next-token distributions, so its drafts carry estimates
    high enough for the target to verify them (the usual tiny model's are ~1/vocab)."""
    return make_tiny_model(initializer_range=1.0)


@pytest.fixture(params=[1, None], ids=["first-layer", "whole-model"])
async def stub(request, peaked_model_dir, monkeypatch):
    # Every step asks the drafter (the gate, which skips asks that do not pay, never trusts its evidence),
    # so every sample below goes through verification.
    monkeypatch.setattr("target_svc.drafting.gate.TYPICAL_EVIDENCE", 10 ** 9)
    # And the step cost model keeps its prior (a draft token ~12% of a step): a start-up profile measured
    # beside a busy test suite could price every draft out, and then nothing here would be verified.
    monkeypatch.setattr("target_svc.cost_model.StepCostModel.profile", lambda self, runner: None)
    monkeypatch.setattr("target_svc.cost_model.StepCostModel.observe", lambda self, *args, **kwargs: None)
    drafter = create_drafter(method="draft_model", address="127.0.0.1:0", metrics_address=None, proposer_args={
        "model": str(peaked_model_dir), "num_layers": request.param, "kv_cache_tokens": 1024})
    await drafter.start()
    target = TargetService(TargetOptions(
        model=str(peaked_model_dir), address="127.0.0.1:0", metrics_address=None, kv_cache_tokens=4096,
        drafters={"draft_model": drafter.grpc_address}, drafter_timeout_s=5.0,
        default_speculative=SpeculativeConfig(method="draft_model", num_speculative_tokens=4)))
    await target.start()
    async with grpc.aio.insecure_channel(target.grpc_address) as channel:
        yield target_pb2_grpc.TargetStub(channel)
    await target.stop(0)
    await drafter.stop(0)


async def generate(stub, method, max_tokens, **sampling):
    request = target_pb2.TargetGenerateRequest(
        prompt_token_ids=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=max_tokens, **sampling),
        speculative=common_pb2.SpeculativeConfig(method=method))
    chunks = [chunk async for chunk in stub.Generate(request)]
    return [t for c in chunks for t in c.token_ids], chunks[-1].usage


async def test_greedy_output_with_draft_model_drafts_is_the_output_without(stub, request):
    plain, _ = await generate(stub, "none", 24)
    drafted, usage = await generate(stub, "draft_model", 24)
    assert drafted == plain
    if "whole-model" in request.node.name:  # its drafts are the target's own argmax, estimated likely: verified
        assert usage.draft_tokens > 0 and usage.accepted_draft_tokens > 0


def two_token_distribution(model_dir) -> dict[tuple[int, int], float]:
    """The target's exact distribution of its first two sampled tokens under top-k TOP_K, temperature 1."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def top_k(ids):
        with torch.inference_mode():
            probs = torch.softmax(model(torch.tensor([ids])).logits[0, -1], dim=-1).topk(TOP_K)
        return zip(probs.indices.tolist(), (probs.values / probs.values.sum()).tolist())

    return {(a, b): pa * pb for a, pa in top_k(PROMPT) for b, pb in top_k([*PROMPT, a])}


async def test_sampled_output_with_draft_model_drafts_follows_the_target_distribution(stub, peaked_model_dir,
                                                                                       request):
    expected = two_token_distribution(peaked_model_dir)
    seen, drafted, accepted = Counter(), 0, 0
    for seed in range(SAMPLES):
        # the second token comes from verifying a one-token draft: accepted, or drawn from the residual
        tokens, usage = await generate(stub, "draft_model", 3, temperature=1.0, top_k=TOP_K, seed=seed)
        seen[tuple(tokens[:2])] += 1
        drafted, accepted = drafted + usage.draft_tokens, accepted + usage.accepted_draft_tokens
    assert set(seen) <= set(expected)
    chi_square = sum((seen[o] - SAMPLES * p) ** 2 / (SAMPLES * p) for o, p in expected.items())
    assert chi_square < 37.7, (chi_square, seen)  # 15 degrees of freedom, p = 0.001
    assert drafted > 0  # the first layer's drafts are rejected, and the target soon stops verifying them
    if "whole-model" in request.node.name:  # its draft is the target's argmax: verified and often accepted
        assert drafted > SAMPLES / 2 and accepted > SAMPLES / 4
