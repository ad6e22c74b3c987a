"""Logits processors, applied identically at every verification row.

Row 0 of a sequence's verification block scores the token after its committed
tokens, row 1 + i the token after draft node i and its ancestors (in a chain,
drafts[:i + 1]), so the repetition penalty sees those drafts as if they had
been accepted. The order follows transformers' `generate`: repetition
penalty, temperature, top-k, top-p.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specd.types import SamplingParams


@dataclass(frozen=True)
class PenalizedRows:
    """One sequence's verification block, as the repetition penalty needs it."""
    first_row: int  # row of the block in the batch's logits
    penalty: float
    history: list[int]  # committed tokens (prompt + output)
    drafts: list[int]  # draft nodes; row first_row + 1 + i comes after node i and its ancestors
    parents: list[int] | None = None  # each node's parent (-1: the root); None: a chain


def apply_repetition_penalty(logits: torch.Tensor, blocks: list[PenalizedRows]) -> None:
    """In place: a token seen before has its logit divided (if > 0) or multiplied (if < 0) by the penalty."""
    for block in blocks:
        history = set(block.history)  # once per sequence; each row adds the drafts on its path
        on_path: list[frozenset[int]] = []  # per node: the draft tokens from the root's child down to it
        parents = block.parents if block.parents is not None else range(-1, len(block.drafts) - 1)
        for j in range(len(block.drafts) + 1):
            if j:
                parent = parents[j - 1]
                on_path.append((on_path[parent] if parent >= 0 else frozenset()) | {block.drafts[j - 1]})
            row = block.first_row + j
            ids = torch.tensor(sorted(history | on_path[j - 1] if j else history), dtype=torch.long,
                               device=logits.device)
            scores = logits[row, ids]
            logits[row, ids] = torch.where(scores > 0, scores / block.penalty, scores * block.penalty)


def to_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[R, V] sampling distribution per row (temperature, top-k, top-p); rows must not be greedy."""
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device).unsqueeze(1)
    logits = logits / temperature
    _mask_top_k(logits, [p.top_k for p in params])
    _mask_top_p(logits, [p.top_p for p in params])
    return torch.softmax(logits, dim=-1)


def _mask_top_k(logits: torch.Tensor, top_ks: list[int]) -> None:
    rows = [i for i, k in enumerate(top_ks) if 0 < k < logits.shape[-1]]
    if not rows:
        return
    ks = torch.tensor([top_ks[i] for i in rows], device=logits.device)
    top_values = logits[rows].topk(int(ks.max()), dim=-1).values  # [r, max_k]
    kth = top_values.gather(1, (ks - 1).unsqueeze(1))  # [r, 1]
    logits[rows] = logits[rows].masked_fill(logits[rows] < kth, float("-inf"))


def _mask_top_p(logits: torch.Tensor, top_ps: list[float]) -> None:
    rows = [i for i, p in enumerate(top_ps) if p < 1.0]
    if not rows:
        return
    sub = logits[rows]
    sorted_logits, order = sub.sort(dim=-1, descending=True)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # Drop a token once the mass before it already reaches top_p; the top token always stays.
    mass_before = cumulative - sorted_logits.softmax(dim=-1)
    drop_sorted = mass_before >= torch.tensor([top_ps[i] for i in rows], dtype=sub.dtype, device=sub.device).unsqueeze(1)
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    logits[rows] = sub.masked_fill(drop, float("-inf"))
