"""The attention plan: block tables, query layout and tree masks every layer's kernel call reads."""
import pytest
import torch

from kernels import cpu, reference
from engine.attention import PagedAttention, SeqSpan, matmul_rows, tree_masks
from engine.kv_cache import KVCache


def test_off_the_cpu_kernel_prompts_from_their_first_token_go_through_sdpa_the_rest_to_the_paged_kernel(
        monkeypatch):
    monkeypatch.setenv("SPECD_KERNELS", "torch")  # the reference kernel, as on CUDA the Triton one
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=8, block_size=4)
    spans = [SeqSpan(start=0, num_new=3, blocks=[4]), SeqSpan(start=5, num_new=2, blocks=[3, 1]),
             SeqSpan(start=0, num_new=2, blocks=[5], parents=[-1, -1]), SeqSpan(start=1, num_new=1, blocks=[6])]
    plan = PagedAttention(spans, torch.arange(8), cache)
    assert plan.prefill_rows == [slice(0, 3)]
    assert plan.paged_rows == slice(3, 8)  # consecutive: a view, no copy
    assert plan.block_tables.tolist() == [[3, 1], [5, 0], [6, 0]]  # padded with block 0, never read
    assert plan.query_start.tolist() == [0, 2, 4, 5]
    assert plan.context_start.tolist() == [5, 0, 1]
    assert plan.tree_offsets.tolist() == [-1, 0, -1]


def test_paged_rows_between_prefills_are_indexed(monkeypatch):
    monkeypatch.setenv("SPECD_KERNELS", "torch")
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=8, block_size=4)
    spans = [SeqSpan(start=2, num_new=1, blocks=[0]), SeqSpan(start=0, num_new=2, blocks=[1]),
             SeqSpan(start=3, num_new=2, blocks=[2, 3])]
    plan = PagedAttention(spans, torch.arange(5), cache)
    assert plan.prefill_rows == [slice(1, 3)] and plan.paged_rows.tolist() == [0, 3, 4]


@pytest.mark.skipif(not cpu.compiled(), reason="the CPU kernels do not build here")
def test_with_the_cpu_kernel_every_query_prompts_included_goes_to_the_paged_kernel(monkeypatch):
    monkeypatch.delenv("SPECD_KERNELS", raising=False)
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=8, block_size=4)
    spans = [SeqSpan(start=0, num_new=3, blocks=[4]), SeqSpan(start=5, num_new=2, blocks=[3, 1])]
    plan = PagedAttention(spans, torch.arange(5), cache)
    assert plan.prefill_rows == [] and plan.paged_rows == slice(0, 5)
    assert plan.context_start.tolist() == [0, 5]


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
    prompt = PagedAttention([SeqSpan(start=0, num_new=6, blocks=[2, 0])], torch.tensor([8, 9, 10, 11, 0, 1]), cache)
    k, v, q = torch.randn(6, 2, 8), torch.randn(6, 2, 8), torch.randn(6, 4, 8)
    prompt.write(1, k, v)
    out = prompt.attend(1, q)
    # The last prompt token sees all six keys: plain attention over them, heads sharing K/V in pairs.
    keys, values = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    weights = torch.einsum("hd,khd->hk", q[5] / 8 ** 0.5, keys).softmax(-1)
    assert torch.allclose(out[5], torch.einsum("hk,khd->hd", weights, values).flatten(), atol=1e-5)
    # Next forward: two drafts after those six tokens beside another prompt.
    spans = [SeqSpan(start=6, num_new=2, blocks=[2, 0]), SeqSpan(start=0, num_new=3, blocks=[3])]
    step = PagedAttention(spans, torch.tensor([2, 3, 12, 13, 14]), cache)
    k, v, q = torch.randn(5, 2, 8), torch.randn(5, 2, 8), torch.randn(5, 4, 8)
    step.write(1, k, v)
    expected = reference.paged_attention(q, cache.keys[1], cache.values[1], torch.tensor([[2, 0], [3, 0]]),
                                         torch.tensor([0, 2, 5]), torch.tensor([6, 0]), None, torch.tensor([-1, -1]),
                                         4, 8 ** -0.5)
    assert torch.allclose(step.attend(1, q), expected.flatten(1), atol=1e-5)


def test_a_long_prompt_goes_through_the_matmuls_on_its_own_and_the_rest_in_runs_of_at_most_128():
    # spans: decode, decode, a 298-token prompt, 200 verification rows, a 100-token prompt; then the row count
    firsts, is_prefill = [0, 1, 2, 300, 500, 600], [False, False, True, False, True]
    assert matmul_rows(firsts, is_prefill) == [slice(0, 2), slice(2, 300), slice(300, 428), slice(428, 556),
                                               slice(556, 600)]
    assert matmul_rows([0, 40], [True]) == [slice(0, 40)]
