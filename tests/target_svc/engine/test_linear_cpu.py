"""Every matmul formulation computes x @ weight^T; choosing one does no work at import."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from target_svc.engine.linear_cpu import linear, onednn_available, onednn_linear, transposed_linear

FORMULATIONS = [linear, transposed_linear] + ([onednn_linear] if onednn_available() else [])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("formulation", FORMULATIONS)
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 8, 9, 40, 130])
def test_every_linear_formulation_matches_torch(formulation, rows, threads):
    x, weight = random_matrix(rows, 48, seed=rows), random_matrix(80, 48, seed=100 + rows)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # linear's choice depends on it
    try:
        out = formulation(x, weight)
    finally:
        torch.set_num_threads(before)
    assert out.shape == (rows, 80) and out.is_contiguous()
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 9, 130])
def test_bf16_linear_is_torch_linear(rows):
    x, weight = random_matrix(rows, 48, seed=rows).bfloat16(), random_matrix(80, 48, seed=1).bfloat16()
    assert torch.equal(linear(x, weight), torch.nn.functional.linear(x, weight))


def test_importing_the_engine_runs_no_onednn_probe():
    # A fresh interpreter: this one has long since probed.
    check = ("import torch, target_svc.engine.runner, target_svc.engine.linear_cpu as m\n"
             "assert m.onednn_available.cache_info().currsize == 0, 'probed at import'\n"
             "m.linear(torch.ones(200, 2), torch.ones(3, 2))\n"
             "assert m.onednn_available.cache_info().currsize == 1, 'linear did not probe on first use'\n")
    repo_root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo_root), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", check], env=env, check=True, timeout=120)


def random_matrix(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
