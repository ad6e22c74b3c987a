"""The EAGLE head: the paged inference head (EagleRunner) computes what the training module computes."""
import pytest
import torch
from safetensors.torch import load_file

from engine.eagle import EagleConfig, EagleRunner
from engine.eagle_module import EagleHeadModule
from engine.runner import SequenceInput

DRAFT_VOCAB = 300


@pytest.fixture
def head(tiny_head):
    return tiny_head


def pairs(n: int, seed: int) -> tuple[list[int], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 49152, (n,), generator=g).tolist(), torch.randn(n, 64, generator=g)


def test_the_paged_head_computes_what_the_training_module_computes_pair_by_pair(head, tiny_model_dir):
    directory, module = head
    runner = EagleRunner(directory, tiny_model_dir, kv_cache_tokens=64, block_size=4)
    ids, features = pairs(10, seed=1)
    with torch.no_grad():
        g = module(torch.tensor([ids]), features[None])[0]  # [T, D]
        expected_logits = module.logits(g)
    # six pairs at once, then the rest one by one on the cache
    logits, out = runner.draft([SequenceInput("s", ids[:6], 0, num_logits=6)], features[:6])
    rows = [logits]
    outs = [out]
    for p in range(6, 10):
        logits, out = runner.draft([SequenceInput("s", ids[p:p + 1], p, num_logits=1)], features[p:p + 1])
        rows.append(logits)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs), g, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.cat(rows), expected_logits, atol=1e-4, rtol=0)


def test_a_saved_head_loads_back_into_a_module_built_with_its_draft_vocabulary(head):
    directory, module = head
    state = load_file(directory / "model.safetensors")
    again = EagleHeadModule(EagleConfig.load(directory), module.embed, module.embed, state["draft_vocab"])
    again.load_inference_state(state)
    assert torch.equal(again.fc.weight, module.fc.weight) and torch.equal(again.lm_head, module.lm_head)
    with pytest.raises(ValueError, match="draft vocabulary"):
        EagleHeadModule(again.config, module.embed, module.embed, torch.arange(DRAFT_VOCAB)).load_inference_state(state)
