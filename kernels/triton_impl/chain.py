"""Chain verification in Triton: one program per sequence, no host synchronisation.

Same signatures and outputs as `kernels.reference.chain`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference.chain import PROB_SCALE

_BLOCK_K = 16  # draft positions per step; k is at most 16, so one step per sequence
_MAX_BLOCK_V = 1024  # vocabulary entries per step of the sampling scans


def greedy_accept(draft_token_ids: torch.Tensor, cu_draft_lens: torch.Tensor,
                  target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    num_seqs = cu_draft_lens.numel() - 1
    num_accepted, next_token = _empty_like_seqs(cu_draft_lens), _empty_like_seqs(cu_draft_lens)
    if num_seqs:
        _greedy_accept_kernel[(num_seqs,)](draft_token_ids, cu_draft_lens, target_argmax, num_accepted,
                                           next_token, BLOCK_K=_BLOCK_K)
    return num_accepted, next_token


def rejection_sample(draft_token_ids: torch.Tensor, cu_draft_lens: torch.Tensor, target_probs: torch.Tensor,
                     draft_probs: torch.Tensor | None, uniform_accept: torch.Tensor,
                     uniform_final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    num_seqs = cu_draft_lens.numel() - 1
    num_accepted = _empty_like_seqs(cu_draft_lens)
    target_probs = target_probs.contiguous()
    if num_seqs:
        _chain_accept_kernel[(num_seqs,)](
            draft_token_ids, cu_draft_lens, target_probs, _draft_probs_arg(draft_probs, target_probs),
            uniform_accept, num_accepted, target_probs.shape[-1], HAS_DRAFT_PROBS=draft_probs is not None,
            BLOCK_K=_BLOCK_K)
    next_token = sample_recovered(draft_token_ids, cu_draft_lens, target_probs, draft_probs,
                                  num_accepted, uniform_final)
    return num_accepted, next_token


def sample_recovered(draft_token_ids: torch.Tensor, cu_draft_lens: torch.Tensor, target_probs: torch.Tensor,
                     draft_probs: torch.Tensor | None, num_accepted: torch.Tensor,
                     uniform_final: torch.Tensor) -> torch.Tensor:
    num_seqs = cu_draft_lens.numel() - 1
    next_token = _empty_like_seqs(cu_draft_lens)
    target_probs = target_probs.contiguous()
    vocab = target_probs.shape[-1]
    if num_seqs:
        _sample_recovered_kernel[(num_seqs,)](
            draft_token_ids, cu_draft_lens, target_probs, _draft_probs_arg(draft_probs, target_probs), num_accepted,
            uniform_final, next_token, vocab, PROB_SCALE=PROB_SCALE, HAS_DRAFT_PROBS=draft_probs is not None,
            BLOCK_V=min(triton.next_power_of_2(vocab), _MAX_BLOCK_V))
    return next_token


def _empty_like_seqs(cu_draft_lens: torch.Tensor) -> torch.Tensor:
    return torch.empty(cu_draft_lens.numel() - 1, dtype=torch.int64, device=cu_draft_lens.device)


def _draft_probs_arg(draft_probs: torch.Tensor | None, target_probs: torch.Tensor) -> torch.Tensor:
    """draft_probs, or a stand-in pointer: without HAS_DRAFT_PROBS the kernels never read it."""
    return target_probs if draft_probs is None else draft_probs.contiguous()


@triton.jit
def _greedy_accept_kernel(draft_ptr, cu_ptr, argmax_ptr, num_accepted_ptr, next_token_ptr,
                          BLOCK_K: tl.constexpr):
    seq = tl.program_id(0)
    first = tl.load(cu_ptr + seq)
    num_drafts = tl.load(cu_ptr + seq + 1) - first
    row = first + seq  # the sequence's first target row; draft i is checked at row + i
    accepted = num_drafts
    for start in range(0, num_drafts, BLOCK_K):
        pos = start + tl.arange(0, BLOCK_K)
        in_draft = pos < num_drafts
        draft = tl.load(draft_ptr + first + pos, mask=in_draft, other=0)
        target = tl.load(argmax_ptr + row + pos, mask=in_draft, other=0)
        rejected_pos = tl.where(in_draft & (draft != target), pos, num_drafts)
        accepted = tl.minimum(accepted, tl.min(rejected_pos, axis=0))
    tl.store(num_accepted_ptr + seq, accepted)
    tl.store(next_token_ptr + seq, tl.load(argmax_ptr + row + accepted))


@triton.jit
def _chain_accept_kernel(draft_ptr, cu_ptr, target_probs_ptr, draft_probs_ptr, uniform_ptr, num_accepted_ptr,
                         vocab, HAS_DRAFT_PROBS: tl.constexpr, BLOCK_K: tl.constexpr):
    seq = tl.program_id(0)
    first = tl.load(cu_ptr + seq)
    num_drafts = tl.load(cu_ptr + seq + 1) - first
    row = first + seq
    accepted = num_drafts
    for start in range(0, num_drafts, BLOCK_K):
        pos = start + tl.arange(0, BLOCK_K)
        in_draft = pos < num_drafts
        draft = tl.load(draft_ptr + first + pos, mask=in_draft, other=0)
        p = tl.load(target_probs_ptr + (row + pos) * vocab + draft, mask=in_draft, other=0.0)
        if HAS_DRAFT_PROBS:
            q = tl.load(draft_probs_ptr + (first + pos) * vocab + draft, mask=in_draft, other=1.0)
        else:
            q = 1.0
        uniform = tl.load(uniform_ptr + first + pos, mask=in_draft, other=0.0)
        rejected_pos = tl.where(in_draft & (uniform * q >= p), pos, num_drafts)  # accept iff u < p / q
        accepted = tl.minimum(accepted, tl.min(rejected_pos, axis=0))
    tl.store(num_accepted_ptr + seq, accepted)


@triton.jit
def _sample_recovered_kernel(draft_ptr, cu_ptr, target_probs_ptr, draft_probs_ptr, num_accepted_ptr,
                             uniform_ptr, next_token_ptr, vocab, PROB_SCALE: tl.constexpr,
                             HAS_DRAFT_PROBS: tl.constexpr, BLOCK_V: tl.constexpr):
    seq = tl.program_id(0)
    first = tl.load(cu_ptr + seq)
    accepted = tl.load(num_accepted_ptr + seq)
    rejected = accepted < tl.load(cu_ptr + seq + 1) - first
    draft_index = tl.where(rejected, first + accepted, 0)  # the rejected draft, if any
    draft = tl.load(draft_ptr + draft_index, mask=rejected, other=-1)
    p_row = target_probs_ptr + (first + seq + accepted) * vocab
    q_row = draft_probs_ptr + draft_index * vocab
    q_len = tl.where(rejected, vocab, 0)  # q is read only at a rejected draft

    # Pass 1: total weights of p and of the residual; an empty residual means sampling from p.
    p_total = tl.full((), 0, tl.int64)
    residual_total = tl.full((), 0, tl.int64)
    for start in range(0, vocab, BLOCK_V):
        p, residual = _p_and_residual(p_row, q_row, q_len, draft, start, vocab, HAS_DRAFT_PROBS, BLOCK_V)
        p_total += tl.sum((p * PROB_SCALE).to(tl.int64), axis=0)
        residual_total += tl.sum((residual * PROB_SCALE).to(tl.int64), axis=0)
    use_residual = rejected & (residual_total > 0)
    total = tl.where(use_residual, residual_total, p_total)

    # Pass 2: the token is the first whose CDF exceeds uniform * total; only its block needs the CDF.
    threshold = (tl.load(uniform_ptr + seq).to(tl.float64) * total.to(tl.float64)).to(tl.int64)
    token = tl.full((), 0, tl.int64) + vocab - 1  # stays only if every weight is 0, as the reference's clamp
    carry = tl.full((), 0, tl.int64)
    for start in range(0, vocab, BLOCK_V):
        p, residual = _p_and_residual(p_row, q_row, q_len, draft, start, vocab, HAS_DRAFT_PROBS, BLOCK_V)
        weights = (tl.where(use_residual, residual, p) * PROB_SCALE).to(tl.int64)  # as the reference's
        token, carry = draw_in_block(weights, start, carry, threshold, token)
    tl.store(next_token_ptr + seq, token)


@triton.jit
def draw_in_block(weights, start, carry, threshold, token):
    """One block of an inverse-CDF draw over fixed-point weights (tokens start ..): the token whose CDF
    first exceeds threshold if that is in this block (else `token` as it was), and the CDF carried
    past the block. Only the block the draw falls in computes its CDF."""
    block_total = tl.sum(weights, axis=0)
    if (carry <= threshold) & (threshold < carry + block_total):
        cdf = carry + tl.cumsum(weights, axis=0)
        token = start + tl.sum((cdf <= threshold).to(tl.int64), axis=0)
    return token, carry + block_total


@triton.jit
def _p_and_residual(p_row, q_row, q_len, draft, start, vocab, HAS_DRAFT_PROBS: tl.constexpr,
                    BLOCK_V: tl.constexpr):
    """p and max(0, p - q) at tokens start .. start + BLOCK_V - 1 (0 past the vocabulary)."""
    token = start + tl.arange(0, BLOCK_V)
    in_vocab = token < vocab
    p = tl.load(p_row + token, mask=in_vocab, other=0.0)
    if HAS_DRAFT_PROBS:
        residual = p - tl.load(q_row + token, mask=token < q_len, other=0.0)
    else:
        residual = tl.where(token == draft, p - 1.0, p)
    return p, tl.maximum(residual, 0.0)

