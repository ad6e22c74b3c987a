"""The training commands' data: the tiny model with the real tokenizer, and a few chats."""
import json

import pytest
from transformers import AutoTokenizer

from specd.model_store import DEFAULT_MODEL, resolve_model

TOPICS = ["the sea", "a cat", "rain", "trains", "bread", "the moon", "chess", "rivers", "snow", "bees"]


@pytest.fixture(scope="module")
def topics():
    """What the chats are about, in order (they repeat three times)."""
    return TOPICS


@pytest.fixture(scope="module")
def chat_model_dir(make_tiny_model):
    """The tiny model with the default model's tokenizer (they share the vocabulary)."""
    path = make_tiny_model()
    AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Tell me about {topic}."},
        {"role": "assistant", "content": f"Here is a short note about {topic}: it is worth a look, again and again."}]})
        + "\n" for topic in TOPICS * 3))
    return path
