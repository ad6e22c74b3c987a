"""The EAGLE head shipped for the default model is trained: on the target's own greedy answers to prompts
written for this test (never in its training data), its first draft token is the target's next token far
more often than chance. Measured here rather than through the services, where the drafting gate verifies
only the few drafts it expects to pay (CI saw 10 verified in three answers)."""
import json
from functools import partial

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from drafter_svc.models.heads import shipped_head
from engine.config import EngineConfig
from engine.eagle import WEIGHTS_FILE, EagleConfig, target_embedding_and_lm_head
from engine.eagle_module import EagleHeadModule
from engine.runner import ModelRunner
from specd.model_store import DEFAULT_MODEL, resolve_model
from specd_cli.train.data import engine_answers, target_features, target_sequences
from specd_cli.train.eagle import evaluate

pytestmark = pytest.mark.e2e

PROMPTS = [
    "Write a short paragraph about why people keep houseplants.",
    "Give three tips for learning to cook at home.",
    "Explain what a compiler does, in a few sentences.",
    "Describe a walk along a beach at sunset.",
]
ANSWER_TOKENS = 96


def test_the_shipped_head_predicts_the_targets_next_token_on_answers_it_never_saw(tmp_path):
    model_dir = resolve_model(DEFAULT_MODEL)
    head_dir = shipped_head(DEFAULT_MODEL)
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"prompt": prompt}) + "\n" for prompt in PROMPTS))
    runner = ModelRunner(model_dir, kv_cache_tokens=4096, engine=EngineConfig.parse("cpu", "bfloat16"))
    answered = list(target_sequences(source, partial(engine_answers, runner), AutoTokenizer.from_pretrained(model_dir),
                                     max_length=512, max_new_tokens=ANSWER_TOKENS))
    sequences = [(torch.tensor(ids), target_features(runner, ids)) for ids in answered]

    state = load_file(head_dir / WEIGHTS_FILE)
    embed, lm_head = target_embedding_and_lm_head(model_dir)
    module = EagleHeadModule(EagleConfig.load(head_dir), embed, lm_head, state["draft_vocab"])
    module.load_inference_state(state)  # bf16 weights, copied into the module's fp32
    top1 = evaluate(module, sequences, lm_head.float())["top1"]

    print(f"shipped head: top-1 {top1:.3f} over {sum(len(ids) - 1 for ids in answered)} positions")
    assert top1 > 0.5  # 0.578 here (the CPU-trained head before it: 0.455); an untrained head: about 1 in 8,192
