"""An accepted tree path's K/V move into place in every layer's packed caches at once: the CPU kernel moves
exactly what the reference moves."""
import pytest
import torch

from kernels import cpu, dispatch, reference
from kernels.layout import pack_keys, pack_values

pytestmark = pytest.mark.skipif(not cpu.compiled(), reason="the CPU kernels cannot be built here (no compiler)")


def _layers(dtype: torch.dtype, count: int = 3) -> list[torch.Tensor]:
    """Every layer's packed key pool, then every layer's value pool: 64 slots of [2 heads, 8 dims]."""
    plain = [torch.randn(64, 2, 8, generator=torch.Generator().manual_seed(i)).to(dtype) for i in range(count)]
    return [pack_keys(p, 16) for p in plain] + [pack_values(p, 16) for p in plain]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_cpu_kernel_moves_what_the_reference_moves(dtype):
    # Nodes at slots 19, 21 and 33 (across a block boundary) take 17, 18 and 19: slot 19 is read before it is
    # overwritten.
    src, dst = torch.tensor([19, 21, 33]), torch.tensor([17, 18, 19])
    moved, expected = _layers(dtype), _layers(dtype)
    cpu.compact_kv(moved, src, dst)
    reference.compact_kv(expected, src, dst)
    assert all(torch.equal(a, b) for a, b in zip(moved, expected))
    assert not all(torch.equal(a, b) for a, b in zip(moved, _layers(dtype)))  # something did move


def test_dispatch_moves_packed_caches_as_the_reference_does_and_no_moves_change_nothing():
    pools = _layers(torch.bfloat16)
    dispatch.compact_kv(pools, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    assert all(torch.equal(a, b) for a, b in zip(pools, _layers(torch.bfloat16)))
    expected = _layers(torch.bfloat16)
    reference.compact_kv(expected, torch.tensor([40]), torch.tensor([2]))
    dispatch.compact_kv(pools, torch.tensor([40]), torch.tensor([2]))
    assert all(torch.equal(a, b) for a, b in zip(pools, expected))
