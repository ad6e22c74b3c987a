"""New entries go into a layer's caches at their slots, in every layout, whatever the implementation."""
import pytest
import torch

from kernels import cpu, dispatch, reference
from kernels.layout import pack_keys, pack_values, read_slots


def _entries(tokens: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """keys and values [T, 2, 8] as strided slices of one [T, 5, 8] projection, as the model gives them."""
    projection = torch.randn(tokens, 5, 8, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return projection[:, 1:3], projection[:, 3:5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("packed", [True, False])
def test_written_entries_read_back_at_their_slots_and_nothing_else_moves(dtype, packed):
    slots_total, block_size = 64, 16
    plain_keys, plain_values = torch.zeros(slots_total, 2, 8, dtype=dtype), torch.zeros(slots_total, 2, 8, dtype=dtype)
    key_pool = pack_keys(plain_keys, block_size) if packed else plain_keys
    value_pool = pack_values(plain_values, block_size) if packed else plain_values
    keys, values = _entries(5, dtype)
    slots = torch.tensor([17, 3, 40, 41, 63])
    dispatch.write_kv(key_pool, value_pool, keys, values, slots)
    assert torch.equal(read_slots(key_pool, slots), keys) and torch.equal(read_slots(value_pool, slots), values)
    others = torch.tensor([s for s in range(slots_total) if s not in slots.tolist()])
    assert not read_slots(key_pool, others).any() and not read_slots(value_pool, others).any()


@pytest.mark.skipif(not cpu.compiled(), reason="the CPU kernels cannot be built here (no compiler)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [3, 600])  # one thread; several
def test_the_cpu_kernel_writes_what_the_reference_writes(dtype, tokens):
    plain = torch.randn(1024, 2, 8).to(dtype)
    caches = [(pack_keys(plain, 16), pack_values(plain, 16)) for _ in range(2)]
    keys, values = _entries(tokens, dtype, seed=1)
    slots = torch.randperm(1024, generator=torch.Generator().manual_seed(2))[:tokens]
    cpu.write_kv(*caches[0], keys, values, slots)
    reference.write_kv(*caches[1], keys, values, slots)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
