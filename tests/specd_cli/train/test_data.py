"""Training conversations: JSONL in three shapes, ShareGPT's JSON array read item by item (its last item is
cut off in the published file), and never the evaluation set."""
import json

import pytest

from specd_cli.bench.prompts import DEFAULT_SPEC_BENCH
from specd_cli.train.data import TrainingDataError, conversations

SHAREGPT_ITEMS = [
    {"id": "a", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]},
    {"id": "b", "conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"},
                                  {"from": "human", "value": "and 3+3?"}, {"from": "gpt", "value": "6"}]},
    {"id": "c", "conversations": [{"from": "bing", "value": "an unknown role: skipped"}]},
]


def test_a_sharegpt_array_cut_off_inside_its_last_item_yields_every_whole_item(tmp_path):
    text = json.dumps(SHAREGPT_ITEMS + [{"id": "d", "conversations": [{"from": "human", "value": "cut"}]}], indent=2)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:-40])  # the file ends inside item "d"
    chats = list(conversations(path))
    assert chats == [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
                     [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                      {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "6"}]]


def test_a_long_array_is_read_in_pieces(tmp_path, monkeypatch):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(SHAREGPT_ITEMS[:2] * 500))
    assert len(list(conversations(path))) == 1000


def test_jsonl_takes_chats_sharegpt_items_and_prompts(tmp_path):
    path = tmp_path / "data.jsonl"
    lines = [{"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]},
             SHAREGPT_ITEMS[0], {"prompt": "Write a poem."}, {"turns": ["First turn", "second turn"]}, {"other": 1}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    chats = list(conversations(path))
    assert [c[0]["content"] for c in chats] == ["Q", "Hi", "Write a poem.", "First turn"]


def test_the_evaluation_set_is_refused(tmp_path):
    path = tmp_path / "spec_bench" / "question.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps({"turns": ["x"]}) + "\n")
    with pytest.raises(TrainingDataError, match="evaluation set"):
        list(conversations(path))


def test_the_spec_bench_questions_shipped_for_specd_bench_are_refused():
    with pytest.raises(TrainingDataError, match="evaluation set"):
        next(conversations(DEFAULT_SPEC_BENCH))
