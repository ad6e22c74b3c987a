"""Every matmul formulation computes x @ weight^T; the engine uses the one measured fastest per row
count, and choosing does no work at import."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from engine.linear_cpu import SPECD_PACKED, PACKED, ROW_BUCKETS, LinearPlan, formulations, onednn_available


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", list(formulations()))
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 8, 9, 40, 130])
def test_every_linear_formulation_matches_torch(name, rows, threads):
    x, weight = random_matrix(rows, 48, seed=rows), random_matrix(80, 48, seed=100 + rows)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = formulations()[name](x, weight)
    finally:
        torch.set_num_threads(before)
    assert out.shape == (rows, 80) and out.is_contiguous()
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight), atol=1e-5, rtol=1e-5)


def test_a_measured_plan_has_a_formulation_for_every_bucket_and_computes_x_times_weight():
    # 90 outputs: not blocks of 16, so specd's packed kernel declines them and the formulations are measured
    plan = LinearPlan.measure([random_matrix(90, 48, seed=1), random_matrix(48, 90, seed=2)], repeats=1)
    assert len(plan.names) == len(ROW_BUCKETS) and set(plan.names) <= set(formulations())
    for rows in (1, 3, 300):
        x, weight = random_matrix(rows, 48, seed=rows), random_matrix(90, 48, seed=3)
        torch.testing.assert_close(plan(x, weight), torch.nn.functional.linear(x, weight), atol=1e-5, rtol=1e-5)


def test_rows_go_to_the_smallest_bucket_that_holds_them():
    names = tuple("transposed" if rows == 8 else "F.linear" for rows in ROW_BUCKETS)
    plan = LinearPlan(names)
    assert plan._choices[3] is formulations()["transposed"]  # buckets 1, 2, 4, 8: rows 5..8 go to 8
    x, weight = random_matrix(6, 48, seed=6), random_matrix(80, 48, seed=1)
    torch.testing.assert_close(plan(x, weight), torch.nn.functional.linear(x, weight), atol=1e-5, rtol=1e-5)


def test_rows_go_through_in_the_slices_given():
    plan = LinearPlan(("F.linear",) * len(ROW_BUCKETS))
    x, weight = random_matrix(300, 48, seed=6), random_matrix(80, 48, seed=1)
    torch.testing.assert_close(plan.by_rows(x, weight, [slice(0, 200), slice(200, 300)]),
                               torch.nn.functional.linear(x, weight), atol=1e-5, rtol=1e-5)


def test_bf16_weights_are_packed_once_and_a_rows_result_does_not_depend_on_the_batch():
    weight = random_matrix(80, 48, seed=1).bfloat16()
    plan = LinearPlan.measure([weight])
    assert len(set(plan.names)) == 1 and plan.names[0] in (PACKED, "F.linear")  # F.linear without oneDNN
    prepared = plan.prepare(weight)
    x = random_matrix(300, 48, seed=9).bfloat16()
    everything = plan(x, prepared)
    assert all(torch.equal(everything[i:i + 1], plan(x[i:i + 1], prepared)) for i in range(0, 300, 29))
    torch.testing.assert_close(everything.float(), torch.nn.functional.linear(x, weight).float(),
                               atol=0.1, rtol=0.02)


@pytest.mark.parametrize("dtype,tolerance", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)], ids=["bf16", "fp32"])
def test_weights_the_packed_kernel_takes_go_to_it_whole_and_a_rows_result_does_not_depend_on_the_batch(
        dtype, tolerance):
    weights = [random_matrix(96, 64, seed=1).to(dtype), random_matrix(64, 96, seed=2).to(dtype)]
    if kernels.pack_linear_weight(weights[0]) is None:
        pytest.skip("no AVX512F on this CPU")
    plan = LinearPlan.measure(weights)
    assert plan.names == (SPECD_PACKED,) * len(ROW_BUCKETS) and plan.any_row_count
    prepared = [plan.prepare(w) for w in weights]
    assert plan.rows_independent(prepared)
    x = random_matrix(300, 64, seed=3).to(dtype)
    assert torch.equal(plan.by_rows(x, prepared[0], [slice(0, 128), slice(128, 300)]), plan(x, prepared[0]))
    torch.testing.assert_close(plan(x, prepared[0]).float(), x.float() @ weights[0].float().t(),
                               atol=tolerance, rtol=tolerance)


def test_row_independence_is_checked_not_assumed():
    weights = [random_matrix(96, 576, seed=1), random_matrix(576, 96, seed=2)]
    mixed = LinearPlan(("F.linear",) + ("transposed",) * (len(ROW_BUCKETS) - 1))  # one row: another GEMM
    assert not mixed.rows_independent(weights)
    bf16 = [w.bfloat16() for w in weights]
    packed = LinearPlan.measure(bf16)
    assert packed.rows_independent([packed.prepare(w) for w in bf16])


def test_importing_the_engine_runs_no_probe():
    # A fresh interpreter: this one has long since probed.
    check = ("import torch, engine.runner, engine.linear_cpu as m\n"
             "assert m.onednn_available.cache_info().currsize == 0, 'probed at import'\n"
             "m.LinearPlan.measure([torch.ones(3, 2)], repeats=1)\n"
             "assert m.onednn_available.cache_info().currsize == 1, 'measuring did not probe'\n")
    subprocess.run([sys.executable, "-c", check], env=_subprocess_env(), check=True, timeout=120)


def test_onednn_caches_stop_growing_at_their_bound():
    # oneDNN caches a primitive and an input-sized buffer per call shape: 480 more row counts unbounded
    # would add ~500 MB; 32 shapes of up to 512 rows hold well under 100.
    check = ("import torch, engine.linear_cpu as m\n"
             "assert m.onednn_available(), 'no oneDNN'\n"
             "def anon_mib():\n"
             "    line = next(l for l in open('/proc/self/status') if l.startswith('RssAnon'))\n"
             "    return int(line.split()[1]) // 1024\n"
             "weight = torch.randn(576, 576)\n"
             "def call_rows(counts):\n"
             "    for rows in counts:\n"
             "        m.onednn_linear(torch.randn(rows, 576), weight)\n"
             "call_rows(range(1, m.ONEDNN_CACHE_SHAPES + 1))\n"
             "full = anon_mib()\n"
             "call_rows(range(m.ONEDNN_CACHE_SHAPES + 1, 513))\n"
             "assert anon_mib() - full < 100, (full, anon_mib())\n")
    if not onednn_available():
        pytest.skip("this torch build has no oneDNN")
    env = {key: value for key, value in _subprocess_env().items()
           if key not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    subprocess.run([sys.executable, "-c", check], env=env, check=True, timeout=120)


def _subprocess_env() -> dict[str, str]:
    repo_root = Path(__file__).resolve().parents[2]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo_root), os.environ.get("PYTHONPATH", "")])}


def random_matrix(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
