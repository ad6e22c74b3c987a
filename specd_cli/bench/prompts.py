"""Prompt sets: Spec-Bench JSONL (question_id, category, turns) and ShareGPT JSON.

Only the first turn of a conversation is sent: a later turn would need the
model's own earlier answer, which differs between sampled runs.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from specd_cli.bench.errors import BenchError

# Shipped inside the package (package data, so a wheel has it too), with its license: see its README.md.
DEFAULT_SPEC_BENCH = Path(__file__).resolve().parent / "data" / "spec_bench" / "question.jsonl"


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    category: str
    text: str  # sent as one user message through the chat template

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.text}]


class PromptFileError(BenchError):
    """The prompt file is missing or not in the expected format."""


def _require(path: Path, what: str) -> None:
    if not path.is_file():
        raise PromptFileError(f"{what} file not found: {path} (pass its path with --prompts / --sharegpt)")


def load_spec_bench(path: Path, categories: list[str] | None = None, limit_per_category: int | None = None
                    ) -> list[Prompt]:
    """Prompts in file order; with a limit, the first N of each category."""
    _require(path, "Spec-Bench")
    prompts, taken = [], {}
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt = Prompt(str(row["question_id"]), row["category"], row["turns"][0])
            except (ValueError, KeyError, IndexError, TypeError) as err:
                raise PromptFileError(f"{path}:{number}: not a Spec-Bench row (question_id, category, turns): {err}")
            if categories and prompt.category not in categories:
                continue
            if limit_per_category is not None and taken.get(prompt.category, 0) >= limit_per_category:
                continue
            taken[prompt.category] = taken.get(prompt.category, 0) + 1
            prompts.append(prompt)
    if categories and (unknown := set(categories) - set(taken)):
        raise PromptFileError(f"{path}: no prompts in categories {', '.join(sorted(unknown))}")
    if not prompts:
        raise PromptFileError(f"{path}: no prompts")
    return prompts


def load_sharegpt(path: Path) -> list[Prompt]:
    """The first human turn of every conversation ({"id", "conversations": [{"from", "value"}, ...]})."""
    _require(path, "ShareGPT")
    try:
        conversations = json.loads(path.read_text())
    except ValueError as err:
        raise PromptFileError(f"{path}: not JSON: {err}")
    prompts = []
    for index, conversation in enumerate(conversations):
        turns = conversation.get("conversations", []) if isinstance(conversation, dict) else []
        first = next((t.get("value") for t in turns if t.get("from") in ("human", "user")), None)
        if first:
            prompts.append(Prompt(str(conversation.get("id", index)), "sharegpt", first))
    if not prompts:
        raise PromptFileError(f"{path}: no conversation with a human turn (ShareGPT format expected)")
    return prompts


def sample_prompts(prompts: list[Prompt], count: int, seed: int) -> list[Prompt]:
    """`count` prompts in a seeded random order, cycling through the set if it is smaller."""
    order = prompts[:]
    random.Random(seed).shuffle(order)
    return [order[i % len(order)] for i in range(count)]


def level_prompts(prompts: list[Prompt], counts: list[int], seed: int) -> list[list[Prompt]]:
    """`counts[i]` prompts for load level i, no level's among an earlier one's where the set holds them all:
    drafters that learn across requests (suffix decoding's global tree, the trie) would otherwise draft a
    level's answers from the same prompts' answers at the levels before (measured: `auto` decoded them in
    half the time, which flattered its throughput and, with the clients' time going to prompt work instead,
    made its TTFT look twice `none`'s at 32 clients)."""
    drawn = sample_prompts(prompts, sum(counts), seed)
    starts = [sum(counts[:level]) for level in range(len(counts))]
    return [drawn[start:start + count] for start, count in zip(starts, counts)]
