"""Row-wise layer ops: the fused CPU kernels round where transformers does, so they give the reference's bits."""
import pytest
import torch

from kernels import cpu, dispatch, reference

compiled = pytest.mark.skipif(not cpu.compiled(), reason="the CPU kernels cannot be built here (no compiler)")
DTYPES = [torch.bfloat16, torch.float16]


def randn(*shape: int, dtype: torch.dtype, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def test_the_reference_norm_adds_the_residual_in_place_and_normalises_in_fp32():
    h, delta, weight = randn(3, 8, dtype=torch.float32), randn(3, 8, dtype=torch.float32, seed=1), torch.full((8,), 2.0)
    expected_h = h + delta
    out = reference.add_rms_norm(h, delta, weight, 1e-5)
    assert torch.equal(h, expected_h)
    torch.testing.assert_close(out, 2 * expected_h / expected_h.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt())


@compiled
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [576, 40])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_the_reference(dtype, dim, with_delta):
    h, weight = randn(9, dim, dtype=dtype), randn(dim, dtype=dtype, seed=2)
    delta = randn(9, dim, dtype=dtype, seed=1) if with_delta else None
    h_reference, h_fused = h.clone(), h.clone()
    expected = reference.add_rms_norm(h_reference, delta, weight, 1e-5)
    actual = cpu.add_rms_norm(h_fused, delta, weight, 1e-5)
    assert torch.equal(h_fused, h_reference)
    torch.testing.assert_close(actual, expected, atol=0, rtol=2 ** -7)  # one rounding step apart at most


@compiled
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [1536, 24])
def test_silu_mul_matches_the_reference(dtype, width):
    gate_up = randn(5, 2 * width, dtype=dtype, scale=4.0)
    assert torch.equal(cpu.silu_mul(gate_up), reference.silu_mul(gate_up))


@compiled
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_equals_the_reference_for_every_gate_value(dtype):
    """The activation is looked up in a table of all 2^16 values of the dtype: each entry must be exact."""
    gate = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(dtype).reshape(1, -1)
    gate_up = torch.cat([gate, torch.ones_like(gate)], dim=1)  # up = 1: the output is silu(gate), rounded
    torch.testing.assert_close(cpu.silu_mul(gate_up), reference.silu_mul(gate_up), rtol=0, atol=0, equal_nan=True)


@compiled
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotate_matches_the_reference_on_strided_rows(dtype):
    x = randn(6, 15, 64, dtype=dtype)[:, :12]  # q and k heads: a slice of the qkv projection
    cos, sin = randn(6, 32, dtype=dtype, seed=1), randn(6, 32, dtype=dtype, seed=2)
    assert torch.equal(cpu.rotate(x, cos, sin), reference.rotate(x, cos, sin))


@compiled
def test_a_row_gets_the_same_bits_whatever_else_is_in_the_batch():
    h, weight = randn(20, 576, dtype=torch.bfloat16), randn(576, dtype=torch.bfloat16, seed=2)
    gate_up = randn(20, 3072, dtype=torch.bfloat16, scale=4.0)
    assert torch.equal(cpu.add_rms_norm(h[7:8].clone(), None, weight, 1e-5)[0],
                       cpu.add_rms_norm(h.clone(), None, weight, 1e-5)[7])
    assert torch.equal(cpu.silu_mul(gate_up[7:8].clone())[0], cpu.silu_mul(gate_up)[7])


@compiled
def test_fp32_runs_the_reference_ops_and_16_bit_types_the_fused_ones(monkeypatch):
    monkeypatch.delenv("SPECD_KERNELS", raising=False)
    assert dispatch._layer_module(torch.zeros(1)) is reference
    assert dispatch._layer_module(torch.zeros(1, dtype=torch.bfloat16)) is cpu
    monkeypatch.setenv("SPECD_KERNELS", "torch")
    assert dispatch._layer_module(torch.zeros(1, dtype=torch.bfloat16)) is reference
