"""Logits processors: what each does, and that drafts count as history."""
import torch

from specd.types import SamplingParams
from target_svc.logits_processors import PenalizedRows, apply_repetition_penalty, to_probs


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    apply_repetition_penalty(logits, [PenalizedRows(0, 2.0, [0, 1], [])])
    assert logits.tolist() == [[1.0, -4.0, 1.0]]


def test_repetition_penalty_treats_earlier_drafts_as_accepted():
    logits = torch.tensor([[4.0, 4.0, 4.0], [4.0, 4.0, 4.0]])
    apply_repetition_penalty(logits, [PenalizedRows(0, 2.0, [0], [2])])
    assert logits.tolist() == [[2.0, 4.0, 4.0], [2.0, 4.0, 2.0]]


def test_rows_outside_penalized_blocks_are_left_alone():
    logits = torch.tensor([[1.0, 2.0], [1.0, 2.0]])
    apply_repetition_penalty(logits, [PenalizedRows(1, 2.0, [1], [])])
    assert logits.tolist() == [[1.0, 2.0], [1.0, 1.0]]


def test_temperature_scales_before_softmax():
    probs = to_probs(torch.tensor([[0.0, 1.0]]), [SamplingParams(temperature=0.5)])
    expected = torch.softmax(torch.tensor([0.0, 2.0]), dim=-1)
    assert torch.allclose(probs[0], expected)


def test_top_k_keeps_only_the_k_most_likely_tokens_per_row():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [1.0, 4.0, 3.0, 2.0]])
    probs = to_probs(logits, [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_k=3)])
    assert (probs[0] > 0).tolist() == [False, True, True, False]
    assert (probs[1] > 0).tolist() == [False, True, True, True]


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = to_probs(logits, [SamplingParams(temperature=1.0, top_p=0.8)])
    assert (probs[0] > 0).tolist() == [True, True, False, False]
    assert torch.allclose(probs[0, :2], torch.tensor([0.625, 0.375]))


def test_top_p_always_keeps_the_top_token():
    probs = to_probs(torch.tensor([[5.0, 0.0]]), [SamplingParams(temperature=1.0, top_p=0.01)])
    assert probs[0].tolist() == [1.0, 0.0]
