"""Turns one forward pass's logits into each sequence's accepted drafts and next token.

Greedy sequences keep drafts that equal the target's argmax; sampled ones go
through lossless rejection sampling. Both run as one kernel call over the
whole batch (flattened, no padding) through `kernels`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from specd.types import SamplingParams
from target_svc.logits_processors import PenalizedRows, apply_repetition_penalty, to_probs


@dataclass
class VerifyInput:
    """One sequence's share of the batch: its logits rows are len(drafts) + 1."""
    sampling: SamplingParams
    history: list[int]
    drafts: list[int]
    generator: torch.Generator


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: int
    next_token: int

    def tokens(self, drafts: list[int]) -> list[int]:
        return [*drafts[:self.num_accepted], self.next_token]


def verify(logits: torch.Tensor, batch: list[VerifyInput]) -> list[VerifyResult]:
    """logits [sum(len(drafts) + 1), V], rows in batch order."""
    row_offsets = _cumsum([len(item.drafts) + 1 for item in batch])
    apply_repetition_penalty(logits, [PenalizedRows(row_offsets[i], item.sampling.repetition_penalty,
                                                    item.history, item.drafts)
                                      for i, item in enumerate(batch) if item.sampling.repetition_penalty != 1.0])
    greedy = [i for i, item in enumerate(batch) if item.sampling.greedy]
    sampled = [i for i, item in enumerate(batch) if not item.sampling.greedy]
    results: dict[int, VerifyResult] = {}
    if greedy:
        results.update(zip(greedy, _verify_greedy(_rows_of(logits, row_offsets, greedy), [batch[i] for i in greedy])))
    if sampled:
        results.update(zip(sampled, _verify_sampled(_rows_of(logits, row_offsets, sampled), [batch[i] for i in sampled])))
    return [results[i] for i in range(len(batch))]


def _verify_greedy(logits: torch.Tensor, batch: list[VerifyInput]) -> list[VerifyResult]:
    drafts, cu_draft_lens = _flat_drafts(batch, logits.device)
    # max's indices are argmax's (the first of equal maxima), 2-3x faster than argmax on CPU (measured).
    num_accepted, next_token = kernels.greedy_accept(drafts, cu_draft_lens, logits.max(dim=-1).indices)
    return _results(num_accepted, next_token)


def _verify_sampled(logits: torch.Tensor, batch: list[VerifyInput]) -> list[VerifyResult]:
    drafts, cu_draft_lens = _flat_drafts(batch, logits.device)
    params = [item.sampling for item in batch for _ in range(len(item.drafts) + 1)]
    probs = to_probs(logits, params)
    # Each sequence draws from its own generator, so a seeded request is
    # reproducible whatever else shares its batch.
    uniform_accept = torch.cat([torch.rand(len(item.drafts), generator=item.generator) for item in batch])
    uniform_final = torch.cat([torch.rand(1, generator=item.generator) for item in batch])
    num_accepted, next_token = kernels.rejection_sample(drafts, cu_draft_lens, probs, None,
                                                        uniform_accept.to(probs.device),
                                                        uniform_final.to(probs.device))
    return _results(num_accepted, next_token)


def _results(num_accepted: torch.Tensor, next_token: torch.Tensor) -> list[VerifyResult]:
    return [VerifyResult(n, t) for n, t in zip(num_accepted.tolist(), next_token.tolist())]  # one copy, not B


def _flat_drafts(batch: list[VerifyInput], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """On the logits' device: kernels pick their implementation by device (Triton on CUDA)."""
    drafts = torch.tensor([t for item in batch for t in item.drafts], dtype=torch.long, device=device)
    cu_draft_lens = torch.tensor(_cumsum([len(item.drafts) for item in batch]), dtype=torch.long, device=device)
    return drafts, cu_draft_lens


def _rows_of(logits: torch.Tensor, row_offsets: list[int], seqs: list[int]) -> torch.Tensor:
    if len(seqs) == len(row_offsets) - 1:
        return logits  # the whole batch: no copy
    index = torch.cat([torch.arange(row_offsets[i], row_offsets[i + 1]) for i in seqs])
    return logits[index]


def _cumsum(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out
