"""KV compaction, specified on the PyTorch reference."""
import torch

from kernels import compact_kv


def _pool(num_slots, fill_offset=0):
    """[num_slots, 2, 3]: every element of slot s holds s + fill_offset."""
    return (torch.arange(num_slots, dtype=torch.float32) + fill_offset).view(-1, 1, 1).expand(-1, 2, 3).clone()


def _slot_values(pool):
    return pool[:, 0, 0].int().tolist()


def test_an_accepted_path_moves_down_over_rejected_nodes():
    # Root at slot 0, tree nodes at 1..5, accepted path = nodes at slots 2 and 5 -> slots 1 and 2.
    pool = _pool(6)
    compact_kv([pool], torch.tensor([2, 5]), torch.tensor([1, 2]))
    assert _slot_values(pool) == [0, 2, 5, 3, 4, 5]  # slot 2 was read before it was overwritten


def test_every_pool_moves_alike():
    keys, values = _pool(4), _pool(4, fill_offset=100)
    compact_kv([keys, values], torch.tensor([3]), torch.tensor([1]))
    assert _slot_values(keys) == [0, 3, 2, 3]
    assert _slot_values(values) == [100, 103, 102, 103]


def test_whole_entries_move_across_heads_and_head_dims():
    pool = torch.randn(5, 2, 3)
    expected = pool.clone()
    expected[0] = pool[4]
    compact_kv([pool], torch.tensor([4]), torch.tensor([0]))
    assert torch.equal(pool, expected)


def test_no_moves_leave_the_pools_untouched():
    pool = _pool(3)
    compact_kv([pool], torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    assert _slot_values(pool) == [0, 1, 2]
