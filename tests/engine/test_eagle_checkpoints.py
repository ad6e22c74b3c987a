"""EAGLE heads as EAGLE's authors publish them load with no training: an EAGLE-1/EAGLE-2 head computes what
EAGLE's layout defines (fc with its bias, a first layer without an input norm, the target's whole vocabulary),
from `pytorch_model.bin` or `model.safetensors`; an EAGLE-3 head drafts from the target layers its config
names, or EAGLE-3's own choice; what cannot run is refused with what does not fit."""
import json

import pytest
import torch

from transformers import LlamaConfig

from engine.config import EngineConfig
from engine.eagle import EagleRunner
from engine.llama import Rope
from engine.eagle_checkpoints import read_head
from engine.runner import SequenceInput
from tests.eagle3_reference import DRAFT_VOCAB, write_published_eagle3_head


def pairs(n: int, seed: int) -> tuple[list[int], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 49152, (n,), generator=g).tolist(), torch.randn(n, 64, generator=g)


@pytest.mark.parametrize("weights_file", ["pytorch_model.bin", "model.safetensors"])
def test_a_published_head_drafts_what_eagles_layout_computes(weights_file, make_published_head, tiny_model_dir):
    directory, module = make_published_head(weights_file)
    runner = EagleRunner(directory, tiny_model_dir, kv_cache_tokens=64, block_size=4)
    assert runner.model.eagle_config.draft_vocab_size == 49152 and not runner.model.eagle_config.input_norm
    ids, features = pairs(8, seed=2)
    with torch.no_grad():
        g = module(torch.tensor([ids]), features[None])[0]
        expected_logits = module.logits(g)
    logits, out = runner.draft([SequenceInput("s", ids[:5], 0, num_logits=5)], features[:5])
    more_logits, more = runner.draft([SequenceInput("s", ids[5:], 5, num_logits=3)], features[5:])
    torch.testing.assert_close(torch.cat([out, more]), g, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.cat([logits, more_logits]), expected_logits, atol=1e-4, rtol=0)


def test_the_bias_and_the_missing_input_norm_both_change_the_drafts(make_published_head):
    """Read as a specd head (an input norm, no bias), the same weights would draft something else: both of
    the layout's differences are in play in the test above."""
    _, module = make_published_head()
    ids, features = pairs(4, seed=3)
    with torch.no_grad():
        published = module(torch.tensor([ids]), features[None])
        module.input_norm = torch.nn.Parameter(torch.ones(64))
        normalized = module(torch.tensor([ids]), features[None])
        module.input_norm = None
        module.fc.bias.zero_()
        without_bias = module(torch.tensor([ids]), features[None])
    assert not torch.allclose(published, normalized, atol=1e-3)
    assert not torch.allclose(published, without_bias, atol=1e-3)


def test_an_eagle3_head_drafts_from_eagle3s_layers_of_the_target_unless_its_config_names_them(tiny_model_dir,
                                                                                              tmp_path):
    write_published_eagle3_head(tiny_model_dir, tmp_path / "default")
    config, state = read_head(tmp_path / "default", 49152, target_layers=30)
    assert config.target_layers == (2, 15, 27) and config.feature_size == 3 * 64
    write_published_eagle3_head(tiny_model_dir, tmp_path / "named", layers=[1, 0, 1])
    assert read_head(tmp_path / "named", 49152, target_layers=2)[0].target_layers == (1, 0, 1)


def test_an_eagle3_heads_draft_vocabulary_is_its_d2t_mapping(tiny_model_dir, tmp_path):
    reference = write_published_eagle3_head(tiny_model_dir, tmp_path, layers=[1, 0, 1])
    config, state = read_head(tmp_path, 49152, target_layers=2)
    assert config.draft_vocab_size == DRAFT_VOCAB and torch.equal(state["draft_vocab"], reference.draft_vocab)
    assert sorted(state) == ["draft_vocab", "fc.weight", "layers.0.hidden_norm.weight",
                             "layers.0.input_layernorm.weight", "layers.0.mlp.down_proj.weight",
                             "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight",
                             "layers.0.post_attention_layernorm.weight", "layers.0.self_attn.k_proj.weight",
                             "layers.0.self_attn.o_proj.weight", "layers.0.self_attn.q_proj.weight",
                             "layers.0.self_attn.v_proj.weight", "lm_head.weight", "norm.weight"]


def test_an_eagle3_head_for_layers_the_target_lacks_is_refused(tiny_model_dir, tmp_path):
    write_published_eagle3_head(tiny_model_dir, tmp_path)
    with pytest.raises(ValueError, match=r"target layers \[2, 1, -1\]; the target has 2"):
        read_head(tmp_path, 49152, target_layers=2)


def test_an_eagle3_head_naming_more_layers_than_its_fc_takes_is_refused(tiny_model_dir, tmp_path):
    write_published_eagle3_head(tiny_model_dir, tmp_path, layers=[0, 1])
    with pytest.raises(ValueError, match="fc takes 192 values a token, not the 2 target layers' 128"):
        read_head(tmp_path, 49152, target_layers=2)


def test_a_head_for_another_vocabulary_is_refused(make_published_head):
    directory, _ = make_published_head()
    with pytest.raises(ValueError, match="vocabulary of 49152 tokens; the target has 32000"):
        read_head(directory, 32000, target_layers=2)


def test_a_head_keeps_the_rope_scaling_its_config_names(make_published_head, tiny_model_dir):
    """EAGLE heads for Llama 3.1 rotate positions as Llama 3.1 does."""
    directory, _ = make_published_head()
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256}
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "rope_scaling": scaling}))
    runner = EagleRunner(directory, tiny_model_dir, kv_cache_tokens=64)
    shape = dict(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=2048, rope_theta=1e5)
    expected = Rope(LlamaConfig(**shape, rope_scaling=scaling), 16, EngineConfig())
    unscaled = Rope(LlamaConfig(**shape), 16, EngineConfig())
    assert torch.equal(runner.model.rope.cos, expected.cos) and not torch.equal(expected.cos, unscaled.cos)


def test_a_head_of_several_layers_is_refused(make_published_head):
    directory, _ = make_published_head()
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="2 layers"):
        read_head(directory, 49152, target_layers=2)


def test_a_directory_without_a_head_says_what_it_looked_for(tmp_path):
    with pytest.raises(FileNotFoundError, match="eagle_config.json.*config.json"):
        read_head(tmp_path, 49152, target_layers=2)


def test_a_head_for_another_hidden_size_is_refused_when_loaded(make_published_head, make_tiny_model):
    directory, _ = make_published_head()
    wider_target = make_tiny_model(hidden_size=128, intermediate_size=256, head_dim=32)
    with pytest.raises(ValueError, match="hidden size 64; the target's is 128"):
        EagleRunner(directory, wider_target, kv_cache_tokens=64)
