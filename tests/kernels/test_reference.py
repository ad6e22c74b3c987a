"""Chain verification, specified on the PyTorch references."""
import torch

from kernels import greedy_accept, rejection_sample, sample_recovered, target_row_offsets


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.long)


def test_target_rows_leave_one_bonus_row_per_sequence():
    assert target_row_offsets(_cu([3, 0, 2])).tolist() == [0, 4, 5, 8]


def test_greedy_accepts_the_prefix_matching_the_argmax_then_corrects():
    drafts = torch.tensor([5, 6, 7])
    argmax = torch.tensor([5, 6, 9, 4])
    num_accepted, next_token = greedy_accept(drafts, _cu([3]), argmax)
    assert num_accepted.tolist() == [2] and next_token.tolist() == [9]


def test_greedy_early_mismatch_rejects_everything_after_it():
    num_accepted, next_token = greedy_accept(torch.tensor([1, 2, 3]), _cu([3]), torch.tensor([8, 2, 3, 4]))
    assert num_accepted.tolist() == [0] and next_token.tolist() == [8]


def test_greedy_fully_accepted_draft_gets_the_bonus_token():
    num_accepted, next_token = greedy_accept(torch.tensor([1, 2]), _cu([2]), torch.tensor([1, 2, 7]))
    assert num_accepted.tolist() == [2] and next_token.tolist() == [7]


def test_greedy_batch_mixes_empty_and_long_drafts():
    drafts = torch.tensor([5, 6, 7, 1, 2])
    argmax = torch.tensor([5, 6, 9, 0, 4, 1, 3, 8])
    num_accepted, next_token = greedy_accept(drafts, _cu([3, 0, 2]), argmax)
    assert num_accepted.tolist() == [2, 0, 1]
    assert next_token.tolist() == [9, 4, 3]


def _sample_many(target_probs, drafts, draft_probs, trials, seed=0):
    """Run rejection sampling `trials` times on one sequence; returns emitted token lists."""
    gen = torch.Generator().manual_seed(seed)
    cu = _cu([len(drafts)] * trials)
    num_accepted, next_token = rejection_sample(
        torch.tensor(drafts * trials), cu, target_probs.repeat(trials, 1),
        None if draft_probs is None else draft_probs.repeat(trials, 1),
        torch.rand(len(drafts) * trials, generator=gen), torch.rand(trials, generator=gen))
    return [drafts[:n] + [t] for n, t in zip(num_accepted.tolist(), next_token.tolist())]


def _empirical(tokens, vocab):
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
    return counts / counts.sum()


def test_rejection_sampling_without_draft_probs_matches_the_target_distribution():
    vocab, trials = 6, 40000
    p0 = torch.tensor([0.05, 0.4, 0.1, 0.2, 0.15, 0.1])
    p1 = torch.tensor([0.3, 0.1, 0.1, 0.1, 0.2, 0.2])
    p2 = torch.tensor([0.1, 0.1, 0.5, 0.1, 0.1, 0.1])
    outputs = _sample_many(torch.stack([p0, p1, p2]), [3, 4], None, trials)
    first = _empirical([o[0] for o in outputs], vocab)
    assert (first - p0.double()).abs().sum() < 0.03  # total variation ~1/sqrt(trials)
    second = _empirical([o[1] for o in outputs if o[0] == 3], vocab)  # continuation after the draft token
    assert (second - p1.double()).abs().sum() < 0.06


def test_rejection_sampling_with_draft_probs_matches_the_target_distribution():
    vocab, trials = 5, 40000
    p = torch.tensor([[0.1, 0.2, 0.3, 0.25, 0.15], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([0.5, 0.1, 0.1, 0.2, 0.1])
    gen = torch.Generator().manual_seed(1)
    drafts = torch.multinomial(q, trials, replacement=True, generator=gen)  # the drafter samples from q
    num_accepted, next_token = rejection_sample(
        drafts, _cu([1] * trials), p.repeat(trials, 1), q.repeat(trials, 1),
        torch.rand(trials, generator=gen), torch.rand(trials, generator=gen))
    first = torch.where(num_accepted == 1, drafts, next_token)
    assert (_empirical(first.tolist(), vocab) - p[0].double()).abs().sum() < 0.03


def test_a_draft_token_the_target_rules_out_is_never_emitted():
    p = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])
    outputs = _sample_many(p, [0], None, 2000)
    assert all(o[0] != 0 for o in outputs)


def test_empty_drafts_sample_the_bonus_row():
    p = torch.tensor([[0.0, 0.0, 1.0]])
    num_accepted, next_token = rejection_sample(torch.tensor([], dtype=torch.long), _cu([0]), p, None,
                                                torch.rand(0), torch.rand(1))
    assert num_accepted.tolist() == [0] and next_token.tolist() == [2]


def _recover_many(p_rows, q_row, num_accepted, trials, draft_token=0, seed=2):
    """Tokens from sample_recovered for `trials` copies of one sequence with a one-token draft."""
    gen = torch.Generator().manual_seed(seed)
    token = sample_recovered(torch.full((trials,), draft_token), _cu([1] * trials), p_rows.repeat(trials, 1),
                             None if q_row is None else q_row.repeat(trials, 1),
                             torch.full((trials,), num_accepted), torch.rand(trials, generator=gen))
    return _empirical(token.tolist(), p_rows.shape[-1])


def test_recovered_token_follows_the_normalised_residual():
    p = torch.tensor([[0.1, 0.2, 0.3, 0.25, 0.15], [0.2] * 5])
    q = torch.tensor([0.5, 0.1, 0.1, 0.2, 0.1])
    residual = torch.tensor([0.0, 0.1, 0.2, 0.05, 0.05]) / 0.4  # max(0, p - q), normalised
    assert (_recover_many(p, q, num_accepted=0, trials=40000) - residual.double()).abs().sum() < 0.03


def test_bonus_token_follows_the_target_at_the_bonus_row():
    p = torch.tensor([[0.2] * 5, [0.1, 0.2, 0.3, 0.25, 0.15]])
    assert (_recover_many(p, None, num_accepted=1, trials=40000) - p[1].double()).abs().sum() < 0.03


def test_without_residual_mass_the_recovered_token_follows_the_target():
    p = torch.tensor([[0.1, 0.2, 0.3, 0.25, 0.15], [0.2] * 5])
    assert (_recover_many(p, p[0], num_accepted=0, trials=40000) - p[0].double()).abs().sum() < 0.03


def test_a_rejected_deterministic_draft_is_never_the_recovered_token():
    p = torch.tensor([[0.1, 0.2, 0.3, 0.25, 0.15], [0.2] * 5])
    assert _recover_many(p, None, num_accepted=0, trials=4000, draft_token=2)[2] == 0
