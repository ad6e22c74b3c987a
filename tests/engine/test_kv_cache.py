import pytest
import torch

import kernels
from engine.config import EngineConfig
from engine.kv_cache import BlockAllocator, KVCache, OutOfBlocks


def test_reserve_allocates_whole_blocks():
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    alloc.reserve("a", 5)  # 2 blocks
    assert alloc.num_free_blocks == 6
    assert alloc.has("a") and not alloc.has("b")
    assert alloc.capacity("a") == 8


def test_reserve_only_grows():
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    alloc.reserve("a", 8)
    alloc.reserve("a", 3)  # already covered
    assert alloc.num_free_blocks == 6
    alloc.reserve("a", 9)
    assert alloc.num_free_blocks == 5


def test_out_of_blocks_allocates_nothing():
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    alloc.reserve("a", 4)
    before = alloc.block_table("a")
    assert not alloc.can_reserve("a", 17)
    with pytest.raises(OutOfBlocks):
        alloc.reserve("a", 17)
    with pytest.raises(OutOfBlocks):
        alloc.reserve("b", 16)
    assert alloc.num_free_blocks == 3
    assert alloc.block_table("a") == before
    assert not alloc.has("b")
    assert alloc.can_reserve("a", 16)


def test_truncate_frees_whole_blocks_past_length():
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    alloc.reserve("a", 12)  # 3 blocks
    alloc.truncate("a", 5)  # positions 0..4 still need 2 blocks
    assert alloc.num_free_blocks == 6
    alloc.truncate("a", 4)
    assert alloc.num_free_blocks == 7
    alloc.truncate("a", 0)
    assert alloc.num_free_blocks == 8
    alloc.truncate("missing", 3)  # no-op


def test_truncate_keeps_the_leading_blocks():
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    alloc.reserve("a", 12)
    table = alloc.block_table("a")
    alloc.truncate("a", 6)
    assert alloc.block_table("a") == table[:2]


def test_free_returns_everything_and_is_idempotent():
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    alloc.reserve("a", 10)
    alloc.reserve("b", 3)
    alloc.free("a")
    alloc.free("a")
    alloc.free("never-seen")
    assert alloc.num_free_blocks == 7
    assert not alloc.has("a")
    alloc.free("b")
    assert alloc.num_free_blocks == 8


def test_freed_blocks_are_reused():
    alloc = BlockAllocator(num_blocks=2, block_size=4)
    alloc.reserve("a", 8)
    alloc.free("a")
    alloc.reserve("b", 8)
    assert sorted(alloc.block_table("b")) == [0, 1]


def test_slots_follow_the_block_table_across_boundaries():
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    # Interleave two sequences so that their blocks alternate.
    for length in (4, 8, 12):
        alloc.reserve("a", length)
        alloc.reserve("b", length)
    table = alloc.block_table("a")
    assert table == [0, 2, 4]
    expected = [table[p // 4] * 4 + p % 4 for p in range(2, 11)]
    slots = alloc.slots("a", 2, 11)
    assert slots.dtype == torch.int64
    assert slots.tolist() == expected
    assert alloc.slots("a", 5, 5).tolist() == []


def test_slots_outside_capacity_raise():
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    alloc.reserve("a", 5)
    with pytest.raises(IndexError):
        alloc.slots("a", 0, 9)
    with pytest.raises(IndexError):
        alloc.slots("b", 0, 1)


def test_kv_cache_pool_shapes():
    cache = KVCache(num_layers=3, num_kv_heads=2, head_dim=8, num_blocks=5, block_size=4)
    assert len(cache.keys) == len(cache.values) == 3
    # packed on CPU, P = 1 in fp32: keys [blocks, KV, Dh / P, block_size, P],
    # values [blocks, KV, block_size / P, Dh * P]
    assert cache.keys[0].shape == (5, 2, 8, 4, 1)
    assert cache.values[2].shape == (5, 2, 4, 8)
    assert cache.keys[0].dtype == torch.float32


def test_a_bf16_cache_packs_two_elements_to_a_lane():
    cache = KVCache(num_layers=1, num_kv_heads=2, head_dim=8, num_blocks=5, block_size=4,
                    engine=EngineConfig(dtype=torch.bfloat16))
    assert cache.keys[0].shape == (5, 2, 4, 4, 2)  # two dims of a position side by side
    assert cache.values[0].shape == (5, 2, 2, 16)  # each dim of two positions side by side


def test_entries_written_by_slot_read_back_by_slot_in_either_layout():
    cache = KVCache(num_layers=1, num_kv_heads=2, head_dim=8, num_blocks=5, block_size=4,
                    engine=EngineConfig(dtype=torch.bfloat16))
    slots, entries = torch.tensor([19, 0, 6]), torch.randn(3, 2, 8).bfloat16()
    for pool in (cache.keys[0], cache.values[0]):
        kernels.write_slots(pool, slots, entries)
        assert torch.equal(kernels.read_slots(pool, slots), entries)
        assert torch.equal(kernels.read_slots(pool, torch.tensor([1])), torch.zeros(1, 2, 8, dtype=torch.bfloat16))

