"""The target sends its features (final-normed hidden states, or the inputs of the layers the drafter names,
as EAGLE-3 drafts from) with the sequence updates to a drafter that wants them, and only to such a drafter:
after a generation with chunked prefill and accepted drafts, the drafter holds the features of every committed
token but the newest, as a fresh forward computes them."""
import grpc
import pytest
import torch

from drafter_svc.proposers.base import DraftRequest
from drafter_svc.proposers.registry import PROPOSERS, register
from drafter_svc.sequences import SequenceState
from drafter_svc.server import create_service as create_drafter
from engine.features import from_bytes
from engine.runner import ModelRunner, SequenceInput
from specd.drafts import DraftTree
from specd.options import OptionSchema
from specd.types import SpeculativeConfig
from specd.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_svc.server import TargetOptions, TargetService
from tests.eagle3_reference import write_published_eagle3_head

PROMPT = [5, 6, 7, 8, 9] * 8  # 40 tokens: three prefill chunks of at most 16; repetitive, so drafts get accepted


class FeatureProbe:
    """Drafts "the last token again" and keeps every feature it is sent, by sequence and position."""
    schema = OptionSchema("feature-probe", wants_features=True)
    received: dict[str, dict[int, torch.Tensor]] = {}

    def propose(self, batch: list[DraftRequest]) -> list[DraftTree]:
        for request in batch:
            held = self.received.setdefault(request.sequence.sequence_id, {})
            for update in request.sequence.new_features:
                rows = from_bytes(update.data, update.dtype, update.hidden_size)
                held.update({update.start_position + i: row for i, row in enumerate(rows)})
            request.sequence.new_features.clear()
        return [DraftTree.chain([r.sequence.tokens[-1]] * r.max_tokens, [0.9] * r.max_tokens) for r in batch]

    def release(self, sequence: SequenceState) -> None:
        pass


class LayerProbe(FeatureProbe):
    """Wants the inputs of layers 1 and 0, in that order (EAGLE-3 takes three of a bigger model's)."""
    schema = OptionSchema("layer-probe", wants_features=True, feature_layers=(1, 0))
    received: dict[str, dict[int, torch.Tensor]] = {}


class MissingLayerProbe(FeatureProbe):
    """Wants a layer the model lacks."""
    schema = OptionSchema("missing-layer-probe", wants_features=True, feature_layers=(7,))
    received: dict[str, dict[int, torch.Tensor]] = {}


class FeatureBlind(FeatureProbe):
    schema = OptionSchema("feature-blind")
    received: dict[str, dict[int, torch.Tensor]] = {}


PROBES = (FeatureProbe, LayerProbe, MissingLayerProbe, FeatureBlind)


@pytest.fixture
async def stub(tiny_model_dir, monkeypatch):
    monkeypatch.setattr("target_svc.drafting.gate.TYPICAL_EVIDENCE", 10 ** 9)  # ask the drafters every step
    drafters = []
    for probe in PROBES:
        register(probe)
        drafters.append(create_drafter(method=probe.schema.method, address="127.0.0.1:0", metrics_address=None))
        await drafters[-1].start()
    target = TargetService(TargetOptions(
        model=str(tiny_model_dir), address="127.0.0.1:0", metrics_address=None, kv_cache_tokens=2048,
        max_num_seqs=4, max_step_tokens=16, drafter_timeout_s=5.0,
        drafters={d.name.removeprefix("drafter[").removesuffix("]"): d.grpc_address for d in drafters},
        default_speculative=SpeculativeConfig(method="feature-probe", num_speculative_tokens=3)))
    await target.start()
    async with grpc.aio.insecure_channel(target.grpc_address) as channel:
        yield target_pb2_grpc.TargetStub(channel)
    await target.stop(0)
    for drafter, probe in zip(drafters, PROBES):
        await drafter.stop(0)
        del PROPOSERS[probe.schema.method]


async def generate(stub, method):
    request = target_pb2.TargetGenerateRequest(
        request_id=f"r-{method}", prompt_token_ids=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=24),
        speculative=common_pb2.SpeculativeConfig(method=method))
    chunks = [chunk async for chunk in stub.Generate(request)]
    return [t for c in chunks for t in c.token_ids], chunks[-1].usage


@pytest.mark.parametrize("probe, layers", [(FeatureProbe, ()), (LayerProbe, (1, 0))])
async def test_the_drafter_holds_the_target_features_of_every_token_but_the_newest(stub, tiny_model_dir, probe,
                                                                                   layers):
    output, usage = await generate(stub, probe.schema.method)
    assert usage.accepted_draft_tokens > 0  # accepted paths' features were kept, not only the newest tokens'
    [held] = probe.received.values()
    tokens = PROMPT + output
    runner = ModelRunner(tiny_model_dir, kv_cache_tokens=128)
    _, expected = runner.forward_with_features([SequenceInput("s", tokens, 0, 0)], list(range(len(tokens))), layers)
    assert expected.shape[1] == 64 * max(1, len(layers))
    # The last ask came before the last step: the features of all tokens but its newest few had come.
    assert len(PROMPT) < len(held) < len(tokens) and sorted(held) == list(range(len(held)))
    torch.testing.assert_close(torch.stack([held[p] for p in range(len(held))]).float(),
                               expected[:len(held)].to(torch.bfloat16).float(), atol=2e-2, rtol=2e-2)


async def test_a_drafter_asking_for_a_layer_the_model_lacks_gets_no_features_and_the_output_is_the_same(stub):
    expected, _ = await generate(stub, "none")
    output, _ = await generate(stub, MissingLayerProbe.schema.method)
    assert output == expected
    assert MissingLayerProbe.received and all(not held for held in MissingLayerProbe.received.values())


@pytest.fixture
async def eagle3_stub(tiny_model_dir, tmp_path, monkeypatch):
    """A real eagle drafter service with an EAGLE-3 head as its authors publish them, beside a real target."""
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


async def test_an_eagle3_head_drafts_from_the_target_layers_it_names_and_the_output_is_the_targets(eagle3_stub):
    expected, _ = await generate(eagle3_stub, "none")
    output, usage = await generate(eagle3_stub, "eagle")
    assert output == expected
    assert usage.draft_tokens > 0  # the features of the layers it named reached the head, which drafted from them


async def test_a_drafter_that_does_not_ask_for_features_gets_none(stub):
    await generate(stub, "feature-blind")
    assert FeatureBlind.received and all(not held for held in FeatureBlind.received.values())
