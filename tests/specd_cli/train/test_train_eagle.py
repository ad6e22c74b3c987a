"""`specd train eagle` from scratch on the tiny model (with the real tokenizer): data prepared once, a head
the eagle drafter loads, held-out top-1 reported, and a second run resumes instead of starting over."""
import json
from functools import partial

import pytest
from transformers import AutoTokenizer

from engine.eagle import EagleConfig, EagleRunner
from specd_cli.main import main


def train(model_dir, data, output, capsys) -> str:
    code = main(["train", "eagle", "--model", str(model_dir), "--data", str(data), "--output", str(output),
                 "--max-tokens", "1500", "--max-length", "64", "--epochs", "1", "--batch-tokens", "256",
                 "--draft-vocab", "32", "--device", "cpu", "--dtype", "float32", "--threads", "2"])
    assert code == 0
    return capsys.readouterr().out


def test_a_head_trained_from_scratch_is_served_and_a_second_run_resumes(chat_model_dir, chats, tmp_path, capsys,
                                                                        caplog):
    output = tmp_path / "head"
    printed = train(chat_model_dir, chats, output, capsys)
    assert "held-out top-1" in printed
    assert EagleConfig.load(output).draft_vocab_size == 32
    runner = EagleRunner(output, chat_model_dir, kv_cache_tokens=64)
    assert runner.model.draft_vocab.shape == (32,)
    prepared = json.loads((output / "data" / "prepared.json").read_text())
    assert prepared["tokens"] >= 1500
    caplog.set_level("INFO")
    train(chat_model_dir, chats, output, capsys)
    assert any("resumed at step" in record.message for record in caplog.records)
    assert json.loads((output / "data" / "prepared.json").read_text()) == prepared  # not prepared again


def test_target_responses_are_the_targets_own_greedy_answers_to_the_first_user_turn(chat_model_dir, chats,
                                                                                      topics):
    import torch
    from transformers import AutoModelForCausalLM

    from engine.runner import ModelRunner
    from specd_cli.train.data import engine_answers, target_sequences

    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    runner = ModelRunner(chat_model_dir, kv_cache_tokens=2048)
    answered = list(target_sequences(chats, partial(engine_answers, runner), tokenizer, max_length=64,
                                     max_new_tokens=6, skip=28, batch_size=4))
    assert len(answered) == 2  # 30 conversations, the first 28 skipped
    model = AutoModelForCausalLM.from_pretrained(chat_model_dir, dtype=torch.float32).eval()
    for ids, topic in zip(answered, topics[8:]):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": f"Tell me about {topic}."}],
                                               add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0].tolist()
        assert ids == expected
    assert runner.allocator.num_free_blocks == runner.allocator.num_blocks


def test_init_from_a_published_head_is_refused_before_any_work_and_points_to_serving_it(make_published_head,
                                                                                       chats, tmp_path):
    directory, _ = make_published_head()
    with pytest.raises(SystemExit, match="--eagle-head"):
        main(["train", "eagle", "--data", str(chats), "--output", str(tmp_path / "out"), "--init", str(directory)])
    assert not (tmp_path / "out").exists()


def test_prepared_with_transformers_the_answers_and_features_are_specd_engines(chat_model_dir, chats):
    """`--prepare-with transformers` (batched generate, for a GPU) yields the same data as specd's engine."""
    import torch

    from engine.runner import ModelRunner
    from specd_cli.train.data import engine_answers, target_features, target_sequences
    from specd_cli.train.transformers_target import TransformersTarget

    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    runner = ModelRunner(chat_model_dir, kv_cache_tokens=2048)
    target = TransformersTarget(chat_model_dir, "cpu", torch.float32)
    by_engine = list(target_sequences(chats, partial(engine_answers, runner), tokenizer, max_length=64,
                                      max_new_tokens=8, skip=24, batch_size=3))
    by_transformers = list(target_sequences(chats, target.answers, tokenizer, max_length=64, max_new_tokens=8,
                                            skip=24, batch_size=3))
    assert len({len(ids) for ids in by_transformers}) > 1  # prompts of different lengths share a batch
    assert by_transformers == by_engine
    for ids in by_engine:
        torch.testing.assert_close(target.features(ids), target_features(runner, ids), atol=2e-2, rtol=2e-2)
