"""Shared fixtures."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

# Small but shaped like the default model: GQA (2 query heads per KV head), tied
# embeddings, and the default model's vocabulary size and special token ids, so
# its tokenizer pairs with it. The larger init std keeps logits well away from
# zero, so numeric comparisons mean something.
TINY_CONFIG = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def write_tiny_model(path: Path, seed: int = 0, **overrides) -> Path:
    """Save a random-weight LlamaForCausalLM (config + safetensors) into `path`."""
    with torch.random.fork_rng():  # seeded without disturbing the caller's RNG
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**{**TINY_CONFIG, **overrides}))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A directory holding a tiny seeded random Llama in Hugging Face format (no tokenizer)."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory):
    """Writes a tiny random Llama with config overrides (e.g. rope_parameters) and returns its directory."""
    def make(seed: int = 0, **overrides) -> Path:
        return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), seed, **overrides)
    return make


def write_random_head(model_dir: Path, path: Path, draft_vocab_size: int = 300, seed: int = 0):
    """A random EAGLE head for the model in `model_dir`, saved as `specd train eagle` saves one, with its
    training module (norm weights away from one, so a mixed-up norm shows)."""
    from safetensors.torch import load_file

    from engine.eagle import EagleConfig, save_head, target_embedding_and_lm_head
    from engine.eagle_module import EagleHeadModule
    from transformers import AutoConfig

    embed, lm_head = target_embedding_and_lm_head(model_dir)
    config = EagleConfig.for_target(AutoConfig.from_pretrained(model_dir), draft_vocab_size, "tiny")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        module = EagleHeadModule(config, embed, lm_head, torch.randperm(embed.shape[0])[:draft_vocab_size])
        for weight in (module.input_norm, module.post_norm):
            weight.data.uniform_(0.5, 1.5)
    save_head(path, config, module.inference_state())
    assert load_file(path / "model.safetensors")["fc.weight"].shape == (config.hidden_size, 2 * config.hidden_size)
    return module


def write_published_head(model_dir: Path, path: Path, weights_file: str = "pytorch_model.bin", seed: int = 0):
    """A random EAGLE-1/EAGLE-2 head for the model in `model_dir`, laid out as EAGLE's authors publish theirs
    (a one-layer Llama `config.json`; `fc.weight`, `fc.bias`, `layers.0.*` without an input norm, and the
    target's `embed_tokens.weight`, in `weights_file`), with its training module."""
    from dataclasses import replace

    from engine.eagle import EagleConfig, target_embedding_and_lm_head
    from engine.eagle_module import EagleHeadModule
    from safetensors.torch import save_file
    from transformers import AutoConfig

    embed, lm_head = target_embedding_and_lm_head(model_dir)
    target = AutoConfig.from_pretrained(model_dir)
    config = replace(EagleConfig.for_target(target, embed.shape[0]), input_norm=False, fc_bias=True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        module = EagleHeadModule(config, embed, lm_head, torch.arange(embed.shape[0]))
        module.post_norm.data.uniform_(0.5, 1.5)
        module.fc.bias.data.normal_(std=0.5)
        for projection in (module.q_proj, module.k_proj):  # attention far from uniform, so positions matter
            projection.weight.data.normal_(std=0.5)
    path.mkdir(parents=True, exist_ok=True)
    LlamaConfig(**{**target.to_dict(), "num_hidden_layers": 1, "architectures": ["LlamaForCausalLM"]}).to_json_file(
        path / "config.json")
    weights = {name: t for name, t in module.inference_state().items() if name != "draft_vocab"}
    weights["embed_tokens.weight"] = embed.clone()
    if weights_file.endswith(".safetensors"):
        save_file(weights, path / weights_file)
    else:
        torch.save(weights, path / weights_file)
    return module


@pytest.fixture
def make_published_head(tiny_model_dir, tmp_path_factory):
    """Writes a random EAGLE-1/EAGLE-2 head for the tiny model in EAGLE's published layout, its weights in the
    file named; returns (its directory, its training module)."""
    def make(weights_file: str = "pytorch_model.bin"):
        path = tmp_path_factory.mktemp("published-head")
        return path, write_published_head(tiny_model_dir, path, weights_file)
    return make


@pytest.fixture(scope="session")
def tiny_head(tiny_model_dir, tmp_path_factory):
    """A random EAGLE head for the tiny model: (its directory, its training module)."""
    path = tmp_path_factory.mktemp("tiny-head")
    return path, write_random_head(tiny_model_dir, path)


@pytest.fixture(scope="session")
def certificates(tmp_path_factory):
    """A CA and loopback certificates for the gateway, the target and a drafter, plus a stranger's."""
    from tests.certificates import Deployment

    return Deployment.make(tmp_path_factory.mktemp("certificates"))
