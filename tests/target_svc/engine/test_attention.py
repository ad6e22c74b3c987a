"""The attention plan: block tables, query layout and tree masks every layer's kernel call reads."""
import torch

from kernels import reference
from target_svc.engine.attention import PagedAttention, SeqSpan, tree_masks
from target_svc.engine.kv_cache import KVCache


def test_the_plan_describes_each_sequence_to_the_kernel():
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=6, block_size=4)
    spans = [SeqSpan(start=5, num_new=2, blocks=[3, 1]), SeqSpan(start=0, num_new=3, blocks=[4])]
    plan = PagedAttention(spans, torch.arange(5), cache)
    assert plan.block_tables.tolist() == [[3, 1], [4, 0]]  # padded with block 0, never read
    assert plan.query_start.tolist() == [0, 2, 5]
    assert plan.context_start.tolist() == [5, 0]
    assert plan.tree_offsets.tolist() == [-1, -1] and plan.tree_mask is None


def test_a_chain_given_as_parents_is_a_chain():
    offsets, mask = tree_masks([SeqSpan(start=2, num_new=3, blocks=[0], parents=[-1, 0, 1])], "cpu")
    assert offsets.tolist() == [-1] and mask is None


def test_tree_spans_get_ancestor_masks_at_their_offsets():
    spans = [SeqSpan(start=4, num_new=3, blocks=[0], parents=[-1, 0, 0]), SeqSpan(start=1, num_new=1, blocks=[1]),
             SeqSpan(start=0, num_new=2, blocks=[2], parents=[-1, -1])]
    offsets, mask = tree_masks(spans, "cpu")
    assert offsets.tolist() == [0, -1, 9]
    assert mask[:9].view(3, 3).tolist() == [[True, False, False], [True, True, False], [True, False, True]]
    assert mask[9:].view(2, 2).tolist() == [[True, False], [False, True]]


def test_attend_reads_what_write_put_in_the_cache():
    torch.manual_seed(0)
    cache = KVCache(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=4, block_size=4)
    spans = [SeqSpan(start=0, num_new=6, blocks=[2, 0]), SeqSpan(start=0, num_new=1, blocks=[3])]
    slots = torch.tensor([8, 9, 10, 11, 0, 1, 12])
    plan = PagedAttention(spans, slots, cache)
    k, v, q = torch.randn(7, 2, 8), torch.randn(7, 2, 8), torch.randn(7, 4, 8)
    plan.write(1, k, v)
    out = plan.attend(1, q)
    # The first sequence's last token sees all six keys: plain attention over them, heads sharing K/V in pairs.
    keys, values = k[:6].repeat_interleave(2, dim=1), v[:6].repeat_interleave(2, dim=1)
    weights = torch.einsum("hd,khd->hk", q[5] / 8 ** 0.5, keys).softmax(-1)
    assert torch.allclose(out[5], torch.einsum("hk,khd->hd", weights, values).flatten(), atol=1e-5)
    # A single token sees only itself.
    assert torch.allclose(out[6], v[6].repeat_interleave(2, dim=0).flatten(), atol=1e-6)
    assert torch.allclose(out, reference.paged_attention(q, cache.keys[1], cache.values[1], plan.block_tables,
                          plan.query_start, plan.context_start, None, plan.tree_offsets, 4, 8 ** -0.5).flatten(1),
                          atol=1e-5)
