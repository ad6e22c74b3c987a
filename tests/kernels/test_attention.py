"""Paged attention: the compiled CPU kernel against the PyTorch reference, and batch invariance."""
import pytest
import torch

from kernels import cpu, dispatch, reference
from kernels.layout import ancestor_mask
from kernels.testing import random_attention_batch

compiled = pytest.mark.skipif(not cpu.compiled(), reason="the CPU kernels cannot be built here (no compiler)")

BATCHES = {
    "decode": ([1, 1, 1], [5, 100, 37]),
    "mixed": ([1, 5, 40, 3], [0, 17, 3, 300]),
    "prefill": ([70], [0]),
    "one_block": ([2, 1], [0, 3]),
    "past_a_chunk": ([9, 12], [130, 70]),  # drafts after whole 64-key chunks of cached prefix
}
# (atol, rtol): bf16 outputs may land one bf16 step (2^-8 relative) apart, e.g. where AMX rounds the weights to bf16
TOLERANCE = {torch.float32: (2e-6, 0), torch.bfloat16: (1e-2, 2 ** -7), torch.float16: (2e-3, 0)}


def test_an_ancestor_mask_follows_parents_down_to_the_prefix():
    assert ancestor_mask([-1, 0, 1, 0]).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]]


@pytest.mark.parametrize("parents", [[0, 0], [-1, 1], [-1, -2]])
def test_a_parent_after_its_child_is_rejected(parents):
    with pytest.raises(ValueError, match="parent"):
        ancestor_mask(parents)


def test_the_reference_is_plain_attention_over_what_each_query_sees():
    batch = random_attention_batch([3], [2], trees=frozenset({0}), heads=2, kv_heads=1, head_dim=4, block_size=2,
                                   seed=3, packed=False)
    out = reference.paged_attention(*batch.args())
    positions = torch.arange(5)
    slots = batch.block_tables[0, positions // 2] * 2 + positions % 2
    keys, values = batch.key_cache[slots, 0], batch.value_cache[slots, 0]  # [5, Dh]: one KV head for both
    mask = batch.tree_mask.view(3, 3)
    for i in range(3):
        seen = torch.cat([torch.ones(2, dtype=torch.bool), mask[i]])
        weights = (keys[seen] @ batch.query[i].T * batch.scale).softmax(0)  # [seen, H]
        torch.testing.assert_close(out[i], weights.T @ values[seen])


@compiled
@pytest.mark.parametrize("dtype", TOLERANCE, ids=str)
@pytest.mark.parametrize("trees", [frozenset(), frozenset({0, 1})], ids=["chains", "trees"])
@pytest.mark.parametrize("shape", BATCHES.values(), ids=BATCHES.keys())
def test_cpu_kernel_matches_the_reference(shape, trees, dtype):
    batch = random_attention_batch(*shape, trees=trees, dtype=dtype)
    expected = reference.paged_attention(*batch.args())
    actual = cpu.paged_attention(*batch.args())
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOLERANCE[dtype][0], rtol=TOLERANCE[dtype][1])


@compiled
@pytest.mark.parametrize("dtype", TOLERANCE, ids=str)
@pytest.mark.parametrize("head_dim, block_size", [(48, 6), (40, 16), (64, 32)])
def test_cpu_kernel_matches_the_reference_for_other_head_dims_and_block_sizes(head_dim, block_size, dtype):
    """Blocks that do not hold whole runs of 16 positions are gathered; head dims need not fill 32 lanes."""
    batch = random_attention_batch([1, 5, 3], [70, 0, 33], trees=frozenset({1}), head_dim=head_dim,
                                   block_size=block_size, dtype=dtype, seed=4)
    expected = reference.paged_attention(*batch.args())
    actual = cpu.paged_attention(*batch.args())
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOLERANCE[dtype][0], rtol=TOLERANCE[dtype][1])


def test_the_reference_reads_packed_and_plain_caches_alike():
    plain = random_attention_batch([2, 1], [20, 7], block_size=4, packed=False, seed=5)
    packed = random_attention_batch([2, 1], [20, 7], block_size=4, packed=True, seed=5)
    assert torch.equal(reference.paged_attention(*plain.args()), reference.paged_attention(*packed.args()))


@compiled
def test_cpu_kernel_reads_strided_query_rows():
    batch = random_attention_batch([4, 2], [9, 30], seed=1)
    wide = torch.cat([batch.query, torch.randn(6, 5, 64)], dim=1)  # queries as a slice of a wider projection
    strided = cpu.paged_attention(wide[:, :9], *batch.args()[1:])
    assert torch.equal(strided, cpu.paged_attention(*batch.args()))


@compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_query_gets_the_same_bits_whatever_else_is_in_the_batch(dtype):
    """A token decoded alone, or verified third among five drafts beside other sequences, attends identically
    (alone, the kernel splits the work by KV head; in the crowd, by sequence)."""
    verify = random_attention_batch([5, 1, 40] + [1] * 8, [98, 7, 300] + [50] * 8, dtype=dtype, seed=2)
    alone = random_attention_batch([1], [100], dtype=dtype, seed=2)
    alone.key_cache, alone.value_cache = verify.key_cache, verify.value_cache
    alone.block_tables = verify.block_tables[:1]
    alone.query = verify.query[2:3]
    in_batch = cpu.paged_attention(*verify.args())[2]
    assert torch.equal(cpu.paged_attention(*alone.args())[0], in_batch)


@compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_prompt_chunk_gets_the_same_bits_split_in_small_tiles_alone_or_whole_in_a_crowd(dtype):
    """Alone, a 16-token chunk deep in a prompt is most of the work: the kernel splits its queries into
    small one-KV-head tiles to keep every thread busy. Among many chunks it is one tile of its own."""
    crowd = random_attention_batch([16] + [40] * 12, [1000] * 13, dtype=dtype, seed=3)
    alone = random_attention_batch([16], [1000], dtype=dtype, seed=3)
    alone.key_cache, alone.value_cache = crowd.key_cache, crowd.value_cache
    alone.block_tables = crowd.block_tables[:1]
    alone.query = crowd.query[:16]
    assert torch.equal(cpu.paged_attention(*alone.args()), cpu.paged_attention(*crowd.args())[:16])


@compiled
def test_dispatch_runs_cpu_tensors_on_the_compiled_kernel_unless_told_otherwise(monkeypatch):
    batch = random_attention_batch([3, 1], [4, 20], dtype=torch.bfloat16)
    monkeypatch.delenv("SPECD_KERNELS", raising=False)
    assert torch.equal(dispatch.paged_attention(*batch.args()), cpu.paged_attention(*batch.args()))
    monkeypatch.setenv("SPECD_KERNELS", "torch")
    assert torch.equal(dispatch.paged_attention(*batch.args()), reference.paged_attention(*batch.args()))


@compiled
def test_the_backend_in_use_is_named(monkeypatch):
    monkeypatch.delenv("SPECD_KERNELS", raising=False)
    assert dispatch.attention_backend(torch.device("cpu")) == "cpu"
    monkeypatch.setenv("SPECD_KERNELS", "torch")
    assert dispatch.attention_backend(torch.device("cpu")) == "reference"
