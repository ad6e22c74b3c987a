"""Chain verification in plain PyTorch: greedy acceptance, rejection sampling, recovered tokens."""
from __future__ import annotations

import torch

from kernels.layout import draft_layout, target_row_offsets

# Tokens are drawn from fixed-point weights (probability * 2^40, truncated): integer
# sums are exact in any order, so every implementation draws the same token from
# the same uniform. Mass below 2^-40 per token is dropped.
PROB_SCALE = 2.0 ** 40


def greedy_accept(draft_token_ids: torch.Tensor, cu_draft_lens: torch.Tensor,
                  target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification.

    draft_token_ids [N], cu_draft_lens [B+1], target_argmax [N+B] (the target's
    choice at every row). Returns (num_accepted [B], next_token [B]): drafts are
    kept while they equal the target's argmax; next_token is the target's argmax
    after the kept prefix (the correction, or the bonus token).
    """
    layout = draft_layout(cu_draft_lens)
    rejected = target_argmax[_checking_rows(cu_draft_lens, *layout)] != draft_token_ids  # [N]
    num_accepted = _first_rejection(rejected, cu_draft_lens, *layout)
    next_token = target_argmax[target_row_offsets(cu_draft_lens)[:-1] + num_accepted]
    return num_accepted, next_token


def rejection_sample(draft_token_ids: torch.Tensor, cu_draft_lens: torch.Tensor, target_probs: torch.Tensor,
                     draft_probs: torch.Tensor | None, uniform_accept: torch.Tensor,
                     uniform_final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling for chains (Leviathan et al.; Chen et al.).

    target_probs [N+B, V] float32: the target distribution at every row, after
    all logits processors. draft_probs [N, V] or None: drafters without
    probabilities proposed deterministically (q = 1 at the draft token).
    uniform_accept [N] and uniform_final [B] are U(0,1) draws from each
    sequence's own generator. Draft i is accepted when uniform_accept[i] < p/q;
    the token after the accepted drafts comes from `sample_recovered`.
    Returns (num_accepted [B], next_token [B]).
    """
    layout = draft_layout(cu_draft_lens)
    p = target_probs[_checking_rows(cu_draft_lens, *layout), draft_token_ids]  # [N]
    q = torch.ones_like(p) if draft_probs is None else draft_probs[
        torch.arange(draft_token_ids.numel(), device=draft_token_ids.device), draft_token_ids]
    num_accepted = _first_rejection(uniform_accept * q >= p, cu_draft_lens, *layout)
    next_token = sample_recovered(draft_token_ids, cu_draft_lens, target_probs, draft_probs,
                                  num_accepted, uniform_final)
    return num_accepted, next_token


def sample_recovered(draft_token_ids: torch.Tensor, cu_draft_lens: torch.Tensor, target_probs: torch.Tensor,
                     draft_probs: torch.Tensor | None, num_accepted: torch.Tensor,
                     uniform_final: torch.Tensor) -> torch.Tensor:
    """[B] the token each sequence emits after its num_accepted [B] accepted drafts.

    After a rejection it is the recovered token, drawn from the residual
    max(0, p - q) at the rejected draft's row (from p when p <= q leaves no
    residual mass); q is draft_probs at that draft, or one-hot at the draft
    token when draft_probs is None. After a fully accepted draft it is the bonus
    token, drawn from p at the bonus row. One inverse-CDF draw per sequence
    from uniform_final [B].
    """
    rows = target_row_offsets(cu_draft_lens)[:-1] + num_accepted  # [B]
    probs = target_probs[rows]  # [B, V], a copy
    rejected = (num_accepted < cu_draft_lens[1:] - cu_draft_lens[:-1]).nonzero().squeeze(1)  # [R]
    if rejected.numel():
        drafts = cu_draft_lens[rejected] + num_accepted[rejected]  # [R] the rejected drafts
        _to_residual_(probs, rejected, draft_token_ids[drafts], None if draft_probs is None else draft_probs[drafts])
    return draw_residual(probs, target_probs, rows, uniform_final)


def draw_residual(residual: torch.Tensor, target_probs: torch.Tensor, rows: torch.Tensor,
                  uniform: torch.Tensor) -> torch.Tensor:
    """[B] one inverse-CDF draw per row of residual [B, V] (overwritten), the residual mass at target
    rows [B]; where none is left (no fixed-point weight), from p at that row: any draw is exact then."""
    cdf = _fixed_point(residual).cumsum_(dim=-1)
    empty = (cdf[:, -1] == 0).nonzero().squeeze(1)
    if empty.numel():
        cdf[empty] = _fixed_point(target_probs[rows[empty]]).cumsum_(dim=-1)
    return _inverse_cdf_sample(cdf, uniform)


def _checking_rows(cu_draft_lens: torch.Tensor, seq_of_draft: torch.Tensor, pos_in_draft: torch.Tensor) -> torch.Tensor:
    """[N] the row whose target choice checks each draft: the row before the draft's own."""
    return target_row_offsets(cu_draft_lens)[seq_of_draft] + pos_in_draft


def _first_rejection(rejected: torch.Tensor, cu_draft_lens: torch.Tensor, seq_of_draft: torch.Tensor,
                     pos_in_draft: torch.Tensor) -> torch.Tensor:
    """[B] number of accepted drafts: the position of each sequence's first rejection, or its draft length."""
    num_accepted = cu_draft_lens[1:] - cu_draft_lens[:-1]
    rejected_pos = torch.where(rejected, pos_in_draft, num_accepted[seq_of_draft])
    return num_accepted.scatter_reduce(0, seq_of_draft, rejected_pos, reduce="amin")


def _to_residual_(probs: torch.Tensor, rows: torch.Tensor, draft_tokens: torch.Tensor,
                  q: torch.Tensor | None) -> None:
    """In place at rows [R] of probs: max(0, p - q); q None stands for one-hot rows at draft_tokens [R]."""
    if q is None:  # p - 0 = p off the draft token: only R entries change
        probs[rows, draft_tokens] = (probs[rows, draft_tokens] - 1.0).clamp_min(0.0)
    else:
        probs[rows] = probs[rows].sub_(q).clamp_min_(0.0)  # the gather is a copy


def _fixed_point(probs: torch.Tensor) -> torch.Tensor:
    """int64 sampling weights from probs (overwritten); scaling by a power of two is exact."""
    return probs.mul_(PROB_SCALE).long()


def _inverse_cdf_sample(cdf: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """[B] one token per row of an int64 CDF [B, V]: the first whose CDF exceeds uniform * total."""
    threshold = (uniform.double() * cdf[:, -1].double()).long()  # [B]
    token = torch.searchsorted(cdf, threshold.unsqueeze(1), right=True).squeeze(1)
    return token.clamp_max(cdf.shape[-1] - 1)
