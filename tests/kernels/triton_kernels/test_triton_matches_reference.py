"""Every Triton kernel gives its reference's outputs: run by Triton's interpreter on CPU, or compiled on
a CUDA GPU where there is one (the interpreter misses what only the compiled kernels do wrong).

Under the interpreter they run in a subprocess started by tests/kernels/test_triton_interpreter.py:
TRITON_INTERPRET must be set before anything imports triton, and tests/conftest.py imports
transformers, which imports triton.
"""
import dataclasses
import os
import random

import pytest
import torch

pytest.importorskip("triton")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU, or TRITON_INTERPRET=1 from the start (test_triton_interpreter.py sets it)",
                allow_module_level=True)
DEVICE = "cpu" if INTERPRETED else "cuda"

from kernels import reference, triton_impl  # noqa: E402
from kernels.testing import ancestor_mask, random_attention_batch, random_batch, random_kv_moves  # noqa: E402

# Kept small: the interpreter runs every program of a launch one after another in Python.
_lengths = random.Random(0)
SHAPES = {
    "single sequence, k=16": [16],
    "empty drafts": [0, 0, 0],
    "k=16 among empty and short drafts": [16, 0, 3, 16, 1, 0, 7, 16],
    "256 sequences": [_lengths.randint(0, 4) for _ in range(256)],
}
VOCAB = 300  # not a power of two: the last block of every vocabulary scan is partial


def _assert_same(actual, expected):
    for got, want in zip(actual, expected, strict=True):
        assert got.dtype == want.dtype and got.tolist() == want.tolist()


@pytest.fixture(params=SHAPES.values(), ids=SHAPES.keys())
def draft_lens(request):
    return request.param


def test_greedy_accept(draft_lens):
    b = random_batch(draft_lens, VOCAB, device=DEVICE)
    args = (b.draft_token_ids, b.cu_draft_lens, b.target_argmax)
    _assert_same(triton_impl.greedy_accept(*args), reference.greedy_accept(*args))


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["q=1", "draft probs"])
def test_rejection_sample(draft_lens, with_draft_probs):
    b = random_batch(draft_lens, VOCAB, device=DEVICE)
    args = (b.draft_token_ids, b.cu_draft_lens, b.target_probs, b.draft_probs if with_draft_probs else None,
            b.uniform_accept, b.uniform_final)
    _assert_same(triton_impl.rejection_sample(*args), reference.rejection_sample(*args))


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["q=1", "draft probs"])
def test_sample_recovered_at_any_accepted_count(with_draft_probs):
    b = random_batch(SHAPES["k=16 among empty and short drafts"], VOCAB, device=DEVICE)
    args = (b.draft_token_ids, b.cu_draft_lens, b.target_probs, b.draft_probs if with_draft_probs else None,
            b.num_accepted, b.uniform_final)
    _assert_same([triton_impl.sample_recovered(*args)], [reference.sample_recovered(*args)])


def test_sample_recovered_over_a_vocabulary_of_several_blocks():
    b = random_batch([3, 0, 5], 2500, device=DEVICE)
    args = (b.draft_token_ids, b.cu_draft_lens, b.target_probs, b.draft_probs, b.num_accepted, b.uniform_final)
    _assert_same([triton_impl.sample_recovered(*args)], [reference.sample_recovered(*args)])


def test_tree_greedy_accept(draft_lens):
    b = random_batch(draft_lens, 8, tree=True, device=DEVICE)
    args = (b.draft_token_ids, b.parent_ids, b.cu_draft_lens, b.target_argmax)
    _assert_same(triton_impl.tree_greedy_accept(*args), reference.tree_greedy_accept(*args))


def test_tree_rejection_sample(draft_lens):
    b = random_batch(draft_lens, VOCAB, tree=True, device=DEVICE)
    args = (b.draft_token_ids, b.parent_ids, b.cu_draft_lens, b.target_probs, b.uniform_accept, b.uniform_final)
    _assert_same(triton_impl.tree_rejection_sample(*args), reference.tree_rejection_sample(*args))


def test_tree_rejection_sample_over_a_vocabulary_of_several_blocks():
    b = random_batch([9, 0, 5, 16], 2500, tree=True, match_rate=0.9, device=DEVICE)
    args = (b.draft_token_ids, b.parent_ids, b.cu_draft_lens, b.target_probs, b.uniform_accept, b.uniform_final)
    _assert_same(triton_impl.tree_rejection_sample(*args), reference.tree_rejection_sample(*args))


def test_build_tree_attention(draft_lens):
    b = random_batch(draft_lens, 8, tree=True, device=DEVICE)
    args = (b.parent_ids, b.cu_draft_lens, b.start_positions)
    _assert_same(triton_impl.build_tree_attention(*args), reference.build_tree_attention(*args))


def test_compact_kv(draft_lens):
    pools, src, dst = random_kv_moves(draft_lens, num_pools=4, kv_heads=2, head_dim=24, device=DEVICE)
    expected = [pool.clone() for pool in pools]
    reference.compact_kv(expected, src, dst)
    triton_impl.compact_kv(pools, src, dst)
    assert all(bool((got == want).all()) for got, want in zip(pools, expected))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("trees", [frozenset(), frozenset({1, 2})], ids=["chains", "trees"])
def test_paged_attention(trees, dtype):
    batch = random_attention_batch([1, 5, 3, 2], [70, 0, 9, 130], trees=trees, heads=4, kv_heads=2, head_dim=16,
                                   dtype=dtype, device=DEVICE, packed=False)  # the Triton kernel reads [slots, KV, Dh]
    expected = reference.paged_attention(*batch.args())
    actual = triton_impl.paged_attention(*batch.args())
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.float(), expected.float(), atol=1e-5 if dtype == torch.float32 else 2e-2,
                               rtol=0)



@pytest.mark.parametrize("cached", [70, 60], ids=["path within a block of keys", "path across two"])
def test_a_tree_node_attends_as_its_path_decoded_alone_bit_for_bit(cached):
    """Greedy speculation with trees is lossless only if a node's attention is the same bits as in the
    steps that decode its path one token at a time (after the path's K/V moved into place)."""
    parents = [-1, -1, 0, 1, 2, 3, 4]  # two branches; the path 0, 2, 4, 6 sits at every other position
    path = [0, 2, 4, 6]
    mask = ancestor_mask(parents).flatten().to(DEVICE)
    tree = random_attention_batch([len(parents)], [cached], trees=frozenset({0}), dtype=torch.float32,
                                  device=DEVICE, packed=False)
    tree = dataclasses.replace(tree, tree_mask=mask)
    tree_rows = triton_impl.paged_attention(*tree.args())[path]
    keys, values = tree.key_cache.clone(), tree.value_cache.clone()
    slots = tree.block_tables[0].repeat_interleave(tree.block_size) * tree.block_size + \
        torch.arange(tree.block_size, device=DEVICE).repeat(tree.block_tables.shape[1])  # position -> slot
    moved_to, moved_from = slots[cached:cached + len(path)], slots[cached + torch.tensor(path, device=DEVICE)]
    keys[moved_to], values[moved_to] = tree.key_cache[moved_from], tree.value_cache[moved_from]
    for depth, node in enumerate(path):  # each decoded alone, after its ancestors
        alone = dataclasses.replace(tree, query=tree.query[node:node + 1], key_cache=keys, value_cache=values,
                                    query_start=torch.tensor([0, 1], device=DEVICE),
                                    context_start=torch.tensor([cached + depth], device=DEVICE), tree_mask=None,
                                    tree_offsets=torch.tensor([-1], device=DEVICE))
        assert torch.equal(triton_impl.paged_attention(*alone.args())[0], tree_rows[depth])

# bf16 only compiled: the interpreter computes bf16 arithmetic wrong.
LAYER_DTYPES = [torch.float32] if INTERPRETED else [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", LAYER_DTYPES, ids=str)
@pytest.mark.parametrize("with_delta", [False, True], ids=["norm", "add and norm"])
def test_add_rms_norm(dtype, with_delta):
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    h, delta = (3 * torch.randn(9, 70, generator=generator, device=DEVICE).to(dtype) for _ in range(2))
    weight = torch.randn(70, generator=generator, device=DEVICE).to(dtype)
    expected_h = h.clone()
    expected = reference.add_rms_norm(expected_h, delta if with_delta else None, weight, 1e-5)
    actual = triton_impl.add_rms_norm(h, delta if with_delta else None, weight, 1e-5)
    assert torch.equal(h, expected_h)  # the residual stream updated in place, bit for bit
    torch.testing.assert_close(actual, expected, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-2)
    for rows in (1, 4):
        assert torch.equal(triton_impl.add_rms_norm(h[:rows].clone(), None, weight, 1e-5),
                           triton_impl.add_rms_norm(h.clone(), None, weight, 1e-5)[:rows])
