"""Which implementation runs: decided per call, by device, SPECD_KERNELS and whether triton is installed."""
import sys

import pytest
import torch

from kernels import reference
from kernels.dispatch import implementation

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def no_triton(monkeypatch):
    """This process, as if triton were not installed."""
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ModuleNotFoundError
    for name in [name for name in sys.modules if name.startswith("kernels.triton_impl")]:
        monkeypatch.delitem(sys.modules, name)


def test_cpu_tensors_run_on_the_references(monkeypatch):
    monkeypatch.delenv("SPECD_KERNELS", raising=False)
    assert implementation(CPU) is reference


def test_cuda_tensors_run_on_triton_when_it_is_installed(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("SPECD_KERNELS", raising=False)
    assert implementation(CUDA).__name__ == "kernels.triton_impl"


def test_specd_kernels_is_read_at_every_call(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("SPECD_KERNELS", "torch")
    assert implementation(CUDA) is reference
    monkeypatch.setenv("SPECD_KERNELS", "triton")
    assert implementation(CPU).__name__ == "kernels.triton_impl"


def test_an_unknown_choice_is_an_error_naming_the_choices(monkeypatch):
    monkeypatch.setenv("SPECD_KERNELS", "cuda")
    with pytest.raises(ValueError, match="triton, torch"):
        implementation(CPU)


def test_without_triton_cuda_tensors_run_on_the_references(monkeypatch, no_triton):
    monkeypatch.delenv("SPECD_KERNELS", raising=False)
    assert implementation(CUDA) is reference


def test_without_triton_asking_for_it_is_a_clear_error(monkeypatch, no_triton):
    monkeypatch.setenv("SPECD_KERNELS", "triton")
    with pytest.raises(RuntimeError, match="`triton` package is not installed"):
        implementation(CPU)
