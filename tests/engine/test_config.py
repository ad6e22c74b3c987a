"""EngineConfig: fp32 on CPU unless told otherwise; the string forms a command line gives."""
import pytest
import torch

from engine.config import EngineConfig, runs_bf16_fast


def test_default_is_fp32_on_cpu():
    assert EngineConfig() == EngineConfig(device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("name, dtype", [
    ("float32", torch.float32), ("fp32", torch.float32),
    ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), ("BF16", torch.bfloat16),
    ("float16", torch.float16), ("fp16", torch.float16),
])
def test_parse_accepts_each_dtype_spelling(name, dtype):
    assert EngineConfig.parse("cpu", name) == EngineConfig(device="cpu", dtype=dtype)


def test_parse_keeps_the_device():
    assert EngineConfig.parse("cuda:1", "bf16").device == "cuda:1"


@pytest.mark.parametrize("device, dtype, named", [
    ("cpu", "float64", "'float64'"), ("cpu", "int8", "'int8'"), ("cpu", "", "''"), ("gpu", "fp32", "'gpu'"),
])
def test_parse_rejects_other_values_by_name(device, dtype, named):
    with pytest.raises(ValueError, match=named):
        EngineConfig.parse(device, dtype)


def test_auto_is_bf16_exactly_where_the_hardware_runs_it_fast():
    auto = EngineConfig.parse("auto", "auto")
    assert auto.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert auto.dtype == (torch.bfloat16 if runs_bf16_fast(auto.device) else torch.float32)
    assert EngineConfig.parse("cpu", "bf16").dtype_name == "bfloat16"


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    from engine.config import _cpu_flags

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16\n")
    assert {"avx512_bf16", "avx512f"} <= _cpu_flags(cpuinfo)
    assert _cpu_flags(tmp_path / "absent") == set()
