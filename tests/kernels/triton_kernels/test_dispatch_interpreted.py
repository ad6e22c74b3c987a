"""SPECD_KERNELS=triton runs the public kernels on CPU tensors through Triton's interpreter."""
import os

import pytest

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 from the start; run by test_triton_interpreter.py",
                allow_module_level=True)

import kernels  # noqa: E402
from kernels import reference  # noqa: E402
from kernels.testing import random_batch  # noqa: E402


def _unused(*args):
    raise AssertionError("the reference ran")


def test_specd_kernels_triton_runs_cpu_tensors_through_the_interpreter(monkeypatch):
    b = random_batch([4, 0, 2], 64)
    expected = reference.greedy_accept(b.draft_token_ids, b.cu_draft_lens, b.target_argmax)
    monkeypatch.setenv("SPECD_KERNELS", "triton")
    monkeypatch.setattr(reference, "greedy_accept", _unused)
    num_accepted, next_token = kernels.greedy_accept(b.draft_token_ids, b.cu_draft_lens, b.target_argmax)
    assert (num_accepted.tolist(), next_token.tolist()) == (expected[0].tolist(), expected[1].tolist())
