"""The packed matmul: x @ weight^T from a weight packed once (bf16 by AMX tile products, AVX512-BF16 dot
products, or widened fp32 FMAs; fp32 by FMAs), each row's result independent of the row count. Runs where
the CPU has AVX512F; elsewhere packing declines and the engine keeps oneDNN or MKL."""
import pytest
import torch

from kernels import cpu, dispatch


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


PACKS = cpu.pack_linear_weight(randn(16, 32)) is not None
packs = pytest.mark.skipif(not PACKS, reason="no AVX512F on this CPU (or no compiler)")


def ways() -> list[str]:
    return list(torch.ops.specd.linear_products()) if PACKS else []


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
@pytest.mark.parametrize("products", ways())
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 37])
def test_every_way_of_forming_the_products_computes_the_same_matmul(products, rows):
    x, weight = randn(rows, 576, seed=rows), randn(80, 576, seed=1)
    out = cpu.linear(x, cpu.pack_linear_weight(weight), products)
    torch.testing.assert_close(out.float(), x.float() @ weight.float().t(), atol=1e-3, rtol=2 ** -7)


@packs
@pytest.mark.skipif(not PACKS or cpu.linear_products().few == cpu.linear_products().many,
                    reason="this process forms every call's products one way")
def test_widened_products_taken_for_many_rows_round_as_the_dot_products_for_few_do():
    weight = randn(96, 576, seed=1)
    packed = cpu.pack_linear_weight(weight)
    x = randn(40, 576, seed=2)
    x[0, :8] = torch.tensor([1e-39, -1e-39, 3e-40, 1e-38, 0.0, -0.0, 1e30, -1e-30]).bfloat16()  # denormals, extremes
    assert torch.equal(cpu.linear(x, packed, "widened"), cpu.linear(x, packed, "dot"))
    many = cpu.linear(x, packed)  # 40 rows: widened
    for row in range(cpu.linear_products().many_from):  # alone: dot
        assert torch.equal(cpu.linear(x[row:row + 1], packed), many[row:row + 1])


@packs
def test_a_way_the_cpu_cannot_form_is_an_error_naming_those_it_can():
    expected = f'products "tiles" cannot be formed on this CPU; it can form: {", ".join(ways())}$'
    with pytest.raises(RuntimeError, match=expected):
        cpu.linear(randn(2, 32), cpu.pack_linear_weight(randn(16, 32)), "tiles")


@packs
def test_the_products_variable_names_one_way_for_every_call_and_rejects_others(monkeypatch):
    try:
        monkeypatch.setenv(cpu.PRODUCTS_VARIABLE, ways()[0])
        cpu.linear_products.cache_clear()
        assert cpu.linear_products().for_rows(1) == cpu.linear_products().for_rows(300) == ways()[0]
        monkeypatch.setenv(cpu.PRODUCTS_VARIABLE, "tiles")
        cpu.linear_products.cache_clear()
        expected = f"SPECD_LINEAR_PRODUCTS='tiles': this CPU can form {', '.join(ways())}$"
        with pytest.raises(ValueError, match=expected):
            cpu.linear_products()
    finally:
        monkeypatch.undo()
        cpu.linear_products.cache_clear()


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
    assert dispatch.pack_linear_weight(randn(16, 32).half()) is None
    assert dispatch.pack_linear_weight(randn(20, 32).float()) is None


@packs
def test_a_mismatched_input_width_is_an_error_naming_both():
    with pytest.raises(RuntimeError, match="x has 64 inputs, the weight 32"):
        cpu.linear(randn(2, 64), cpu.pack_linear_weight(randn(16, 32)))


@packs
@pytest.mark.parametrize("rows", [0, 1, 3, 4, 5, 17, 300])
@pytest.mark.parametrize("outputs,inputs", [(16, 1), (48, 576), (576, 1536)])
def test_fp32_weights_compute_x_times_weight_transposed_a_rows_result_whatever_the_row_count(rows, outputs, inputs):
    x, weight = randn(rows, inputs, seed=rows).float(), randn(outputs, inputs, seed=1).float()
    packed = dispatch.pack_linear_weight(weight)
    out = dispatch.packed_linear(x, packed)
    assert out.shape == (rows, outputs) and out.dtype == torch.float32
    torch.testing.assert_close(out, x @ weight.t(), atol=1e-4, rtol=1e-5)
    for row in range(0, rows, 7):
        assert torch.equal(dispatch.packed_linear(x[row:row + 1], packed), out[row:row + 1])


@packs
def test_fp32_weights_take_fp32_rows_and_fma_products_only():
    packed = cpu.pack_linear_weight(randn(16, 32).float())
    with pytest.raises(RuntimeError, match="x must be fp32, as the weight is"):
        cpu.linear(randn(2, 32), packed)
    with pytest.raises(RuntimeError, match='fp32 weights take "fma" products, not "dot"'):
        cpu.linear(randn(2, 32).float(), packed, "dot")
