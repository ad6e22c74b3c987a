"""Turns one forward pass's logits into each sequence's accepted drafts and next token.

A draft is a token tree (a chain is the tree whose every node has one child), and every draft goes
the same way: greedy sequences keep the deepest path whose tokens equal the target's argmax; sampled
ones go through lossless tree rejection sampling. Each is one kernel call over the whole batch
(flattened, no padding) through `kernels`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

import kernels
from specd.types import SamplingParams, TokenLogprobs
from target_svc.logits_processors import PenalizedRows, apply_repetition_penalty, to_probs


@dataclass
class VerifyInput:
    """One sequence's share of the batch: its logits rows are len(drafts) + 1 (the root, then a row per
    draft node)."""
    sampling: SamplingParams
    history: list[int]
    drafts: list[int]
    generator: torch.Generator
    parents: list[int] | None = None  # each draft node's parent (-1: the root); None: a chain

    @property
    def parent_ids(self) -> list[int]:
        return self.parents if self.parents is not None else list(range(-1, len(self.drafts) - 1))


@dataclass(frozen=True)
class VerifyResult:
    next_token: int
    path: tuple[int, ...] = ()  # the accepted draft nodes, from the root's child down
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per emitted token, when the request asked for them

    @property
    def num_accepted(self) -> int:
        return len(self.path)

    def tokens(self, drafts: list[int]) -> list[int]:
        """The tokens the step emits: the accepted path's, then the next token."""
        return [*(drafts[node] for node in self.path), self.next_token]


def verify(logits: torch.Tensor, batch: list[VerifyInput]) -> list[VerifyResult]:
    """logits [sum(len(drafts) + 1), V], rows in batch order."""
    row_offsets = _cumsum([len(item.drafts) + 1 for item in batch])
    apply_repetition_penalty(logits, [PenalizedRows(row_offsets[i], item.sampling.repetition_penalty,
                                                    item.history, item.drafts, item.parents)
                                      for i, item in enumerate(batch) if item.sampling.repetition_penalty != 1.0])
    greedy = [i for i, item in enumerate(batch) if item.sampling.greedy]
    sampled = [i for i, item in enumerate(batch) if not item.sampling.greedy]
    results: dict[int, VerifyResult] = {}
    if greedy:
        results.update(zip(greedy, _verify_greedy(_rows_of(logits, row_offsets, greedy), [batch[i] for i in greedy])))
    if sampled:
        results.update(zip(sampled, _verify_sampled(_rows_of(logits, row_offsets, sampled),
                                                    [batch[i] for i in sampled])))
    for i, item in enumerate(batch):
        if item.sampling.logprobs is not None:
            results[i] = replace(results[i], logprobs=_logprobs(logits, row_offsets[i], item, results[i]))
    return [results[i] for i in range(len(batch))]


def _logprobs(logits: torch.Tensor, first_row: int, item: VerifyInput,
              result: VerifyResult) -> tuple[TokenLogprobs, ...]:
    """Each emitted token's log probability at its row (the root's, then each accepted node's), under
    the distribution its request samples from: what `none` reports for the same tokens. A greedy request
    has none to sample from; it gets the one at temperature 1, after the same processors."""
    rows = [first_row, *(first_row + 1 + node for node in result.path)]
    params = item.sampling if not item.sampling.greedy else replace(item.sampling, temperature=1.0)
    log_probs = to_probs(logits[rows].float(), [params] * len(rows)).log()
    tokens = torch.tensor(result.tokens(item.drafts), device=log_probs.device)
    chosen = log_probs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    top = log_probs.topk(item.sampling.logprobs, dim=-1) if item.sampling.logprobs else None
    return tuple(TokenLogprobs(lp, tuple(zip(top.indices[j].tolist(), top.values[j].tolist())) if top else ())
                 for j, lp in enumerate(chosen))


def _verify_greedy(logits: torch.Tensor, batch: list[VerifyInput]) -> list[VerifyResult]:
    drafts, parents, cu_draft_lens = _flat_trees(batch, logits.device)
    # max's indices are argmax's (the first of equal maxima), 2-3x faster than argmax on CPU (measured).
    return _results(*kernels.tree_greedy_accept(drafts, parents, cu_draft_lens, logits.max(dim=-1).indices),
                    cu_draft_lens)


def _verify_sampled(logits: torch.Tensor, batch: list[VerifyInput]) -> list[VerifyResult]:
    drafts, parents, cu_draft_lens = _flat_trees(batch, logits.device)
    params = [item.sampling for item in batch for _ in range(len(item.drafts) + 1)]
    probs = to_probs(logits, params)
    # Each sequence draws from its own generator, so a seeded request is
    # reproducible whatever else shares its batch.
    uniform_accept = torch.cat([torch.rand(len(item.drafts), generator=item.generator) for item in batch])
    uniform_final = torch.cat([torch.rand(1, generator=item.generator) for item in batch])
    return _results(*kernels.tree_rejection_sample(drafts, parents, cu_draft_lens, probs,
                                                   uniform_accept.to(probs.device), uniform_final.to(probs.device)),
                    cu_draft_lens)


def _results(num_accepted: torch.Tensor, accepted_nodes: torch.Tensor, next_token: torch.Tensor,
             cu_draft_lens: torch.Tensor) -> list[VerifyResult]:
    nodes, starts = accepted_nodes.tolist(), cu_draft_lens.tolist()  # one copy each, not B
    return [VerifyResult(t, tuple(nodes[start:start + n]))
            for n, t, start in zip(num_accepted.tolist(), next_token.tolist(), starts)]


def _flat_trees(batch: list[VerifyInput], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft tokens, parents and cu_draft_lens on the logits' device: kernels pick their implementation
    by device (Triton on CUDA)."""
    as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    return (as_tensor([t for item in batch for t in item.drafts]),
            as_tensor([p for item in batch for p in item.parent_ids]),
            as_tensor(_cumsum([len(item.drafts) for item in batch])))


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
