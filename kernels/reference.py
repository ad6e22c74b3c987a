"""Plain PyTorch implementations of the verification kernels (vectorised, any device)."""
from __future__ import annotations

import torch


def target_row_offsets(cu_draft_lens: torch.Tensor) -> torch.Tensor:
    """[B+1] start of each sequence's target rows: drafts plus one bonus row each."""
    return cu_draft_lens + torch.arange(cu_draft_lens.numel(), device=cu_draft_lens.device)


def _draft_layout(cu_draft_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For every draft token: its sequence, its position in that draft, and its target row."""
    draft_lens = cu_draft_lens[1:] - cu_draft_lens[:-1]  # [B]
    num_seqs = draft_lens.numel()
    seq_of_draft = torch.repeat_interleave(torch.arange(num_seqs, device=draft_lens.device), draft_lens)  # [N]
    pos_in_draft = torch.arange(seq_of_draft.numel(), device=draft_lens.device) - cu_draft_lens[seq_of_draft]
    row_of_draft = seq_of_draft + torch.arange(seq_of_draft.numel(), device=draft_lens.device)
    return seq_of_draft, pos_in_draft, row_of_draft


def _first_rejection(rejected: torch.Tensor, cu_draft_lens: torch.Tensor) -> torch.Tensor:
    """[B] number of accepted drafts: the position of each sequence's first rejection, or its draft length."""
    seq_of_draft, pos_in_draft, _ = _draft_layout(cu_draft_lens)
    num_accepted = cu_draft_lens[1:] - cu_draft_lens[:-1]
    rejected_pos = torch.where(rejected, pos_in_draft, num_accepted[seq_of_draft])
    return num_accepted.scatter_reduce(0, seq_of_draft, rejected_pos, reduce="amin")


def greedy_accept(draft_token_ids: torch.Tensor, cu_draft_lens: torch.Tensor,
                  target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification.

    draft_token_ids [N], cu_draft_lens [B+1], target_argmax [N+B] (the target's
    choice at every row). Returns (num_accepted [B], next_token [B]): drafts are
    kept while they equal the target's argmax; next_token is the target's argmax
    after the kept prefix (the correction, or the bonus token).
    """
    _, _, row_of_draft = _draft_layout(cu_draft_lens)
    rejected = target_argmax[row_of_draft] != draft_token_ids
    num_accepted = _first_rejection(rejected, cu_draft_lens)
    next_token = target_argmax[target_row_offsets(cu_draft_lens)[:-1] + num_accepted]
    return num_accepted, next_token


def rejection_sample(draft_token_ids: torch.Tensor, cu_draft_lens: torch.Tensor, target_probs: torch.Tensor,
                     draft_probs: torch.Tensor | None, uniform_accept: torch.Tensor,
                     uniform_final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling for chains (Leviathan et al.; Chen et al.).

    target_probs [N+B, V]: the target distribution at every row, after all logits
    processors. draft_probs [N, V] or None: drafters without probabilities
    proposed deterministically (q = 1 at the draft token). uniform_accept [N] and
    uniform_final [B] are U(0,1) draws from each sequence's own generator.
    Draft i is accepted with probability min(1, p/q); the final token is drawn
    from the residual max(0, p - q) at the first rejection (recovered token) or
    from p after a fully accepted draft (bonus token).
    """
    seq_of_draft, _, row_of_draft = _draft_layout(cu_draft_lens)
    p_draft = target_probs[row_of_draft, draft_token_ids]  # [N]
    q_draft = torch.ones_like(p_draft) if draft_probs is None else draft_probs[
        torch.arange(draft_token_ids.numel(), device=draft_token_ids.device), draft_token_ids]
    rejected = uniform_accept * q_draft >= p_draft  # accept iff u < p / q
    num_accepted = _first_rejection(rejected, cu_draft_lens)

    final_rows = target_row_offsets(cu_draft_lens)[:-1] + num_accepted  # [B]
    final_probs = target_probs[final_rows].clone()  # [B, V]
    draft_lens = cu_draft_lens[1:] - cu_draft_lens[:-1]
    was_rejected = num_accepted < draft_lens
    if bool(was_rejected.any()):
        rejected_seqs = was_rejected.nonzero().squeeze(1)
        rejected_draft = cu_draft_lens[rejected_seqs] + num_accepted[rejected_seqs]  # index into N
        if draft_probs is None:
            q_rows = torch.zeros_like(final_probs[rejected_seqs])
            q_rows[torch.arange(rejected_seqs.numel()), draft_token_ids[rejected_draft]] = 1.0
        else:
            q_rows = draft_probs[rejected_draft]
        residual = (final_probs[rejected_seqs] - q_rows).clamp_min(0.0)
        # p == q leaves no residual mass; any sample from p is then exact.
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        final_probs[rejected_seqs] = torch.where(empty, final_probs[rejected_seqs], residual)
    return num_accepted, _inverse_cdf_sample(final_probs, uniform_final)


def _inverse_cdf_sample(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """[B] one token per row of unnormalised probs [B, V], from a U(0,1) draw per row."""
    cdf = probs.cumsum(dim=-1)  # [B, V]
    threshold = (uniform * cdf[:, -1]).unsqueeze(1)
    token = torch.searchsorted(cdf, threshold, right=True).squeeze(1)
    return token.clamp_max(probs.shape[-1] - 1)
