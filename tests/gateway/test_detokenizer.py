import pytest

from gateway.detokenizer import IncrementalDetokenizer

MIXED_TEXT = (" Héllo wörld! Ça va? 😀👍🏽 日本語のテキスト, 中文字符 and ﬁne naïve café — “quotes” 🇯🇵\n"
              "  two  spaces\tand a tab, then Ελληνικά and русский текст.")


def stream(tokenizer, token_ids, chunk_size):
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add(token_ids[i:i + chunk_size]) for i in range(0, len(token_ids), chunk_size)]
    return deltas + [detokenizer.flush()]


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 5, 8, 17])
def test_deltas_join_to_the_full_decode(tokenizer, chunk_size):
    token_ids = tokenizer.encode_prompt(MIXED_TEXT)
    assert "".join(stream(tokenizer, token_ids, chunk_size)) == tokenizer.decode(token_ids) == MIXED_TEXT


@pytest.mark.parametrize("chunk_size", [1, 3])
def test_no_delta_holds_a_half_character(tokenizer, chunk_size):
    token_ids = tokenizer.encode_prompt(MIXED_TEXT)
    assert all("\ufffd" not in delta for delta in stream(tokenizer, token_ids, chunk_size))


def test_a_character_split_over_tokens_is_emitted_once_complete(tokenizer):
    token_ids = tokenizer.encode_prompt(" 😀")
    assert len(token_ids) > 1, "the emoji must span several byte-level tokens for this test"
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.add([t]) for t in token_ids[:-1]] == [""] * (len(token_ids) - 1)
    assert detokenizer.add(token_ids[-1:]) == " 😀"


def test_a_chunk_ending_mid_character_emits_the_text_before_it(tokenizer):
    hello, emoji = tokenizer.encode_prompt("Hello"), tokenizer.encode_prompt(" 😀")
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.add(hello + emoji[:1]) == "Hello"
    assert detokenizer.add(emoji[1:]) == " 😀"


def test_leading_space_of_the_first_token_is_kept_as_in_a_full_decode(tokenizer):
    token_ids = tokenizer.encode_prompt(" The answer is 42")
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.add(token_ids[:1]) == " The"
    assert detokenizer.add(token_ids[1:]) == " answer is 42"


def test_special_tokens_are_skipped(tokenizer):
    token_ids = tokenizer.encode_chat([("user", "Hi 😀")])
    assert "".join(stream(tokenizer, token_ids, 1)) == tokenizer.decode(token_ids)
    assert "<|im_start|>" not in tokenizer.decode(token_ids)


def test_flush_emits_an_unfinished_character_as_a_full_decode_would(tokenizer):
    dangling = tokenizer.encode_prompt(" 😀")[:-1]
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.add(dangling) == ""
    assert detokenizer.flush() == tokenizer.decode(dangling)
    assert detokenizer.flush() == ""
