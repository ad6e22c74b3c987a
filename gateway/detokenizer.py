"""Token ids to text deltas, one verification step at a time.

Decoding a single token on its own is wrong in two ways: a multi-byte UTF-8
character split over several byte-level tokens decodes to "\ufffd", and
tokenizers that mark word starts (sentencepiece "▁", byte-level "Ġ") decode a
token differently at the start of a text than after other tokens. So each step
decodes a short window that begins with tokens already emitted (the prefix),
and emits only what the window adds beyond the prefix's text, once that text
no longer ends in an unfinished character.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

_INCOMPLETE_CHARACTER = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...


class IncrementalDetokenizer:
    """Feed the tokens of one generation; the deltas joined equal decoding all of them at once."""

    def __init__(self, tokenizer: Decoder):
        self._tokenizer = tokenizer
        self._token_ids: list[int] = []
        self._prefix_offset = 0  # start of the window: tokens whose text was already emitted
        self._read_offset = 0  # tokens before this are emitted

    def add(self, token_ids: Iterable[int]) -> str:
        """The new text these tokens complete; a character still missing bytes waits for the next tokens."""
        # One token at a time, so a chunk ending mid-character still emits everything before that character.
        return "".join(self._add_one(token_id) for token_id in token_ids)

    def flush(self) -> str:
        """Whatever is still held back: the generation has ended, nothing will complete it."""
        prefix_text, window_text = self._decode_window()
        self._prefix_offset = self._read_offset = len(self._token_ids)
        return window_text[len(prefix_text):]

    def _add_one(self, token_id: int) -> str:
        self._token_ids.append(token_id)
        prefix_text, window_text = self._decode_window()
        if len(window_text) <= len(prefix_text) or window_text.endswith(_INCOMPLETE_CHARACTER):
            return ""  # a special token, or a character still missing bytes
        self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
        return window_text[len(prefix_text):]

    def _decode_window(self) -> tuple[str, str]:
        prefix_text = self._tokenizer.decode(self._token_ids[self._prefix_offset:self._read_offset])
        window_text = self._tokenizer.decode(self._token_ids[self._prefix_offset:])
        return prefix_text, window_text
