"""The model's tokenizer, loaded from the resolved model directory."""
from __future__ import annotations

from collections.abc import Sequence

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from specd.model_store import resolve_model


class Tokenizer:
    """Text to token ids and back, the way the model was trained to see them."""

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase):
        self._hf = hf_tokenizer
        # No token stands for more characters of text than its own spelling has (a byte-level
        # token spells each byte as one character), so text longer than tokens x this cannot fit.
        self.max_token_chars = max(map(len, hf_tokenizer.get_vocab()))

    @classmethod
    def load(cls, model: str) -> Tokenizer:
        return cls(AutoTokenizer.from_pretrained(resolve_model(model)))

    def encode_prompt(self, text: str) -> list[int]:
        """Raw text as is; special tokens (a BOS, say) only where the tokenizer adds them by default."""
        return self._hf.encode(text)

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """(role, content) pairs rendered through the chat template, ending with the assistant's turn opening."""
        conversation = [{"role": role, "content": content} for role, content in messages]
        # The template writes every special token itself, so none is added on top.
        encoding = self._hf.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                                return_dict=True)
        return list(encoding["input_ids"])

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's own text (a piece of a character, for a token that is one: U+FFFD)."""
        return self._hf.batch_decode([[token_id] for token_id in token_ids])

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of token_ids, special tokens left out."""
        return self._hf.decode(token_ids, skip_special_tokens=True)
