"""specd's response chunks in OpenAI's shapes: chat.completion(.chunk) and text_completion."""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence

from specd.v1 import common_pb2, generation_pb2

# A token's text from its id (the gateway's tokenizer): logprobs name their tokens by text, as OpenAI's do.
TokenTexts = Callable[[Sequence[int]], list[str]]

# A stop string is a stop to OpenAI.
FINISH_REASONS = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
                  common_pb2.FINISH_REASON_STOP_STRING: "stop"}


def finish_reason(response: generation_pb2.GenerateResponse) -> str | None:
    return FINISH_REASONS.get(response.finish_reason)


def usage_json(usage: common_pb2.Usage) -> dict:
    """OpenAI's usage, plus what speculation did for the request."""
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "draft_tokens": usage.draft_tokens, "accepted_draft_tokens": usage.accepted_draft_tokens,
            "verification_steps": usage.verification_steps}


class ResponseShape:
    """One request's envelope (id, created, model) and its endpoint's choice shape."""
    id_prefix: str
    object: str
    chunk_object: str

    def __init__(self, model: str, token_texts: TokenTexts, with_token_ids: bool = False):
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.token_texts = token_texts
        self.with_token_ids = with_token_ids

    def envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    def chunk(self, response: generation_pb2.GenerateResponse, first: bool) -> dict:
        return self.envelope(self.chunk_object, [{"index": 0, **self._delta(response.text, first),
                                                  "logprobs": self._logprobs_of([response]),
                                                  "finish_reason": finish_reason(response),
                                                  **self._token_ids(response.token_ids)}])

    def usage_chunk(self, usage: common_pb2.Usage) -> dict:
        return {**self.envelope(self.chunk_object, []), "usage": usage_json(usage)}

    def whole(self, responses: list[generation_pb2.GenerateResponse]) -> dict:
        text = "".join(response.text for response in responses)
        token_ids = [token_id for response in responses for token_id in response.token_ids]
        last = responses[-1]
        return {**self.envelope(self.object, [{"index": 0, **self._whole(text),
                                               "logprobs": self._logprobs_of(responses),
                                               "finish_reason": finish_reason(last),
                                               **self._token_ids(token_ids)}]), "usage": usage_json(last.usage)}

    def _token_ids(self, token_ids) -> dict:
        return {"token_ids": list(token_ids)} if self.with_token_ids else {}

    def _logprobs_of(self, responses: list[generation_pb2.GenerateResponse]) -> dict | None:
        """The responses' tokens with their logprobs in the endpoint's shape; None if none were asked for."""
        pairs = [(token_id, lp) for r in responses for token_id, lp in zip(r.token_ids, r.logprobs)]
        if not pairs:
            return None
        texts = self.token_texts([t for t, lp in pairs for t in (t, *lp.top_token_ids)])
        at, tokens = 0, []
        for _, lp in pairs:  # each token's text, then its top tokens' texts, as flattened above
            top = list(zip(texts[at + 1:at + 1 + len(lp.top_token_ids)], lp.top_logprobs))
            tokens.append((texts[at], lp.logprob, top))
            at += 1 + len(lp.top_token_ids)
        return self._logprobs(tokens)

    def _logprobs(self, tokens: list[tuple[str, float, list[tuple[str, float]]]]) -> dict:
        raise NotImplementedError

    def _delta(self, text: str, first: bool) -> dict:
        raise NotImplementedError

    def _whole(self, text: str) -> dict:
        raise NotImplementedError


class ChatShape(ResponseShape):
    id_prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def _delta(self, text: str, first: bool) -> dict:
        return {"delta": {"role": "assistant", "content": text} if first else {"content": text}}

    def _whole(self, text: str) -> dict:
        return {"message": {"role": "assistant", "content": text}}

    def _logprobs(self, tokens: list[tuple[str, float, list[tuple[str, float]]]]) -> dict:
        def entry(text: str, logprob: float) -> dict:
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
        return {"content": [{**entry(text, logprob), "top_logprobs": [entry(t, lp) for t, lp in top]}
                            for text, logprob, top in tokens]}


class CompletionShape(ResponseShape):
    id_prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def _delta(self, text: str, first: bool) -> dict:
        return {"text": text}

    def _whole(self, text: str) -> dict:
        return {"text": text}

    def _logprobs(self, tokens: list[tuple[str, float, list[tuple[str, float]]]]) -> dict:
        return {"tokens": [text for text, _, _ in tokens], "token_logprobs": [lp for _, lp, _ in tokens],
                "top_logprobs": [dict(top) for _, _, top in tokens]}
