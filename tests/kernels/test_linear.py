"""The bf16 matmul: x @ weight^T from a weight packed once (AMX tile products, or AVX512-BF16 dot products),
each row's result independent of the row count. Runs where the CPU has AVX512-BF16; elsewhere packing
declines and the engine keeps oneDNN."""
import pytest
import torch

from kernels import cpu, dispatch


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


packs = pytest.mark.skipif(cpu.pack_linear_weight(randn(16, 32)) is None,
                           reason="no AVX512-BF16 on this CPU (or no compiler)")


@packs
@pytest.mark.parametrize("rows", [0, 1, 15, 16, 17, 33, 130, 300])
@pytest.mark.parametrize("outputs,inputs", [(16, 32), (48, 576), (576, 1536)])
def test_packed_linear_computes_x_times_weight_transposed(rows, outputs, inputs):
    x, weight = randn(rows, inputs, seed=rows), randn(outputs, inputs, seed=1)
    out = dispatch.packed_linear(x, dispatch.pack_linear_weight(weight))
    assert out.shape == (rows, outputs) and out.dtype == torch.bfloat16
    # fp32 sums of bf16 products, rounded once: within bf16's rounding of the exact result
    torch.testing.assert_close(out.float(), x.float() @ weight.float().t(), atol=1e-3, rtol=2 ** -7)


@packs
def test_a_rows_result_does_not_depend_on_the_row_count_or_the_row_stride():
    x, weight = randn(300, 576), randn(960, 576, seed=1)
    packed = cpu.pack_linear_weight(weight)
    everything = cpu.linear(x, packed)
    for row in (0, 15, 16, 255, 256, 299):
        assert torch.equal(cpu.linear(x[row:row + 1], packed), everything[row:row + 1])
    wide = randn(300, 600, seed=2)
    wide[:, :576] = x
    assert torch.equal(cpu.linear(wide[:, :576], packed), everything)  # strided rows, as a slice of a wider one


@packs
def test_packing_declines_what_the_tiles_cannot_hold():
    assert dispatch.pack_linear_weight(randn(20, 32)) is None  # outputs not a multiple of 16
    assert dispatch.pack_linear_weight(randn(16, 40)) is None  # inputs not a multiple of 32
    assert dispatch.pack_linear_weight(randn(16, 32).float()) is None
    assert dispatch.pack_linear_weight(randn(16, 32).half()) is None


@packs
def test_a_mismatched_input_width_is_an_error_naming_both():
    with pytest.raises(RuntimeError, match="x has 64 inputs, the weight 32"):
        cpu.linear(randn(2, 64), cpu.pack_linear_weight(randn(16, 32)))
