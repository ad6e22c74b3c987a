"""EngineConfig: fp32 on CPU unless told otherwise; the string forms a command line gives."""
import pytest
import torch

from target_svc.engine.config import EngineConfig


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
