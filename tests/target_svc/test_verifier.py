"""Verification turns logits into accepted drafts plus one token, losslessly."""
import pytest
import torch

from specd.types import SamplingParams
from target_svc.logits_processors import PenalizedRows, apply_repetition_penalty, to_probs
from target_svc.verifier import VerifyInput, verify


def _logits_favouring(tokens, vocab=8):
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def test_greedy_accepts_drafts_matching_the_argmax():
    batch = [VerifyInput(SamplingParams(), [1], [3, 4, 5], torch.Generator())]
    [result] = verify(_logits_favouring([3, 4, 6, 7]), batch)
    assert (result.num_accepted, result.next_token) == (2, 6)
    assert result.tokens([3, 4, 5]) == [3, 4, 6]


def test_greedy_argmax_sees_the_repetition_penalty_at_every_draft_position():
    # Row 1 would pick token 3, but token 3 is the draft before it, so the penalty applies as if accepted.
    logits = torch.tensor([[0.0, 0, 0, 3.0, 0, 0, 0, 0], [0.0, 0, 2.0, 3.0, 0, 0, 0, 0]])
    batch = [VerifyInput(SamplingParams(repetition_penalty=2.0), [0], [3], torch.Generator())]
    [result] = verify(logits, batch)
    assert (result.num_accepted, result.next_token) == (1, 2)


def test_mixed_batch_keeps_each_sequence_its_own_rows():
    batch = [VerifyInput(SamplingParams(), [0], [2], torch.Generator()),
             VerifyInput(SamplingParams(temperature=1.0, top_k=1), [0], [5, 6], torch.Generator()),
             VerifyInput(SamplingParams(), [0], [], torch.Generator())]
    results = verify(_logits_favouring([2, 3, 5, 6, 1, 7]), batch)
    assert [(r.num_accepted, r.next_token) for r in results] == [(1, 3), (2, 1), (0, 7)]


def test_seeded_sampling_is_reproducible_whatever_shares_the_batch():
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))

    def run(extra):
        gen = torch.Generator().manual_seed(42)
        batch = [VerifyInput(SamplingParams(temperature=1.0), [0], [1, 2], gen), *extra]
        rows = torch.cat([logits, torch.zeros(sum(len(e.drafts) + 1 for e in extra), 8)])
        return verify(rows, batch)[0]

    alone = run([])
    shared = run([VerifyInput(SamplingParams(temperature=1.0), [0], [4], torch.Generator().manual_seed(7))])
    assert alone == shared


def test_sampled_first_token_follows_the_processed_target_distribution():
    vocab, trials = 8, 20000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5, 0.2, 0.1], [0.0] * 8])
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
    gen = torch.Generator().manual_seed(3)
    batch = [VerifyInput(params, [0], [1], gen) for _ in range(trials)]
    results = verify(logits.repeat(trials, 1), batch)
    first = torch.tensor([1 if r.num_accepted else r.next_token for r in results])
    empirical = torch.bincount(first, minlength=vocab).double() / trials
    expected = to_probs(logits[:1].clone(), [params])[0].double()
    assert (empirical - expected).abs().sum() < 0.04


def test_greedy_keeps_the_tree_branch_that_follows_the_argmax():
    # root ─┬─ 0:3 ── 2:4
    #       └─ 1:5 ── 3:6      rows: root, node 0, node 1, node 2, node 3
    batch = [VerifyInput(SamplingParams(), [1], [3, 5, 4, 6], torch.Generator(), parents=[-1, -1, 0, 1])]
    [result] = verify(_logits_favouring([5, 0, 6, 0, 2]), batch)
    assert result.path == (1, 3) and result.tokens([3, 5, 4, 6]) == [5, 6, 2]


def test_the_repetition_penalty_at_a_tree_row_sees_only_that_nodes_ancestors():
    # Node 1 (token 3) is a sibling of node 0 (token 2), not an ancestor: at node 0's row token 3 is not
    # penalised, token 2 is.
    logits = torch.tensor([[0.0, 0, 3.0, 0, 0], [0.0, 0, 3.0, 2.0, 0], [0.0] * 5])
    batch = [VerifyInput(SamplingParams(repetition_penalty=2.0), [0], [2, 3], torch.Generator(), parents=[-1, -1])]
    [result] = verify(logits, batch)
    assert result.tokens([2, 3]) == [2, 3]


def test_sampled_tree_drafts_keep_the_first_token_on_the_processed_target_distribution():
    vocab, trials = 8, 20000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5, 0.2, 0.1], [0.0] * 8, [0.0] * 8])
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
    gen = torch.Generator().manual_seed(4)
    batch = [VerifyInput(params, [0], [1, 5], gen, parents=[-1, -1]) for _ in range(trials)]
    results = verify(logits.repeat(trials, 1), batch)
    first = torch.tensor([r.tokens([1, 5])[0] for r in results])
    empirical = torch.bincount(first, minlength=vocab).double() / trials
    expected = to_probs(logits[:1].clone(), [params])[0].double()
    assert (empirical - expected).abs().sum() < 0.04


def test_logprobs_are_each_emitted_tokens_at_its_own_row_after_every_processor():
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.3, logprobs=3)
    item = VerifyInput(params, [0, 2], [1, 6, 4], torch.Generator().manual_seed(0))
    penalized = logits.clone()
    [result] = verify(logits, [item])
    rows = [0, *(1 + node for node in result.path)]
    assert len(result.logprobs) == len(result.tokens(item.drafts)) == len(rows)
    apply_repetition_penalty(penalized, [PenalizedRows(0, 1.3, [0, 2], [1, 6, 4])])
    for row, token, reported in zip(rows, result.tokens(item.drafts), result.logprobs):
        expected = to_probs(penalized[row:row + 1], [params]).log()[0]
        assert reported.logprob == pytest.approx(expected[token].item(), abs=1e-5)
        top = expected.topk(3)
        assert [t for t, _ in reported.top] == top.indices.tolist()
        assert [lp for _, lp in reported.top] == pytest.approx(top.values.tolist(), abs=1e-5)


def test_a_greedy_requests_logprobs_are_at_temperature_one_and_none_are_made_unasked():
    logits = torch.tensor([[0.0, 1.0, 3.0, 0.0], [2.0, 0.0, 0.0, 0.0]])
    asked = VerifyInput(SamplingParams(logprobs=0), [0], [2], torch.Generator())
    unasked = VerifyInput(SamplingParams(), [0], [2], torch.Generator())
    first, second = verify(torch.cat([logits, logits]), [asked, unasked])
    assert first.tokens([2]) == [2, 0]
    expected = torch.log_softmax(logits, dim=-1)
    assert [lp.logprob for lp in first.logprobs] == pytest.approx([expected[0, 2].item(), expected[1, 0].item()])
    assert all(lp.top == () for lp in first.logprobs)
    assert second.logprobs == ()
