"""`specd train corpus` on the tiny model: the target's answers alone, one per conversation, into a corpus file
the learning drafters start from."""
from functools import partial

from transformers import AutoTokenizer

from drafter_svc import warm_corpus
from drafter_svc.proposers.suffix import SuffixProposer
from engine.runner import ModelRunner
from specd_cli.main import main
from specd_cli.train.data import engine_answers, first_turn_prompts, target_sequences


def test_the_corpus_holds_the_targets_greedy_answers_without_their_prompts(chat_model_dir, chats, tmp_path, capsys):
    output = tmp_path / "corpus.npz"
    assert main(["train", "corpus", "--model", str(chat_model_dir), "--data", str(chats), "--output", str(output),
                 "--conversations", "5", "--max-new-tokens", "6", "--max-length", "64", "--device", "cpu",
                 "--dtype", "float32", "--threads", "2"]) == 0
    assert "5 answers" in capsys.readouterr().out
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    runner = ModelRunner(chat_model_dir, kv_cache_tokens=2048)
    prompts = list(first_turn_prompts(chats, tokenizer, max_length=64, max_new_tokens=6))[:5]
    whole = list(target_sequences(chats, partial(engine_answers, runner), tokenizer, max_length=64,
                                  max_new_tokens=6, batch_size=5))[:5]
    outputs = warm_corpus.load(output)
    assert outputs == [sequence[len(prompt):] for prompt, sequence in zip(prompts, whole)]
    assert all(0 < len(output) <= 6 for output in outputs)
    assert warm_corpus.model_of(output) == str(chat_model_dir)
    assert SuffixProposer(warm_outputs=outputs).sizes()["corpus_tokens"] == sum(map(len, outputs))
