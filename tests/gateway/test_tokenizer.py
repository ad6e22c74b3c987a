import pytest
from transformers import AutoTokenizer

from specd.model_store import DEFAULT_MODEL, resolve_model


@pytest.fixture(scope="module")
def hf_tokenizer():
    """The Hugging Face tokenizer itself, to look at special tokens the gateway's decode leaves out."""
    return AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL))


def test_prompt_is_encoded_as_is_without_a_bos_the_tokenizer_does_not_add(tokenizer, hf_tokenizer):
    token_ids = tokenizer.encode_prompt("Hello world")
    assert hf_tokenizer.bos_token_id not in token_ids
    assert tokenizer.decode(token_ids) == "Hello world"


def test_chat_is_rendered_through_the_template_and_opens_the_assistant_turn(tokenizer, hf_tokenizer):
    token_ids = tokenizer.encode_chat([("system", "Be brief."), ("user", "Hi!")])
    assert hf_tokenizer.decode(token_ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")


def test_chat_special_tokens_come_from_the_template_only(tokenizer, hf_tokenizer):
    im_start = hf_tokenizer.convert_tokens_to_ids("<|im_start|>")
    token_ids = tokenizer.encode_chat([("user", "Hi!")])
    # The template's default system turn, the user turn and the assistant turn: no extra BOS on top.
    assert token_ids.count(im_start) == 3
    assert token_ids[0] == im_start


def test_decode_leaves_special_tokens_out(tokenizer):
    assert tokenizer.decode(tokenizer.encode_chat([("user", "Hi!")])).endswith("user\nHi!\nassistant\n")
