"""The attention mask: what each new token sees, built from the sequence's attention structure."""
import pytest
import torch

from target_svc.engine.attention import GROUP_COST_KEYS, SeqSpan, attention_mask, by_context_length

NOT_A_CHAIN = [-1, 0, 0]  # two tokens following the first: a tree


def visible(mask: torch.Tensor) -> list[list[list[int]]]:
    """[G, 1, n, L] additive mask -> for each sequence and query, the key indices it sees."""
    return [[torch.nonzero(row == 0).flatten().tolist() for row in seq[0]] for seq in mask]


def test_chain_query_sees_the_cached_prefix_and_the_new_tokens_before_it():
    spans = [SeqSpan(start=2, num_new=2, blocks=[0]), SeqSpan(start=0, num_new=1, blocks=[1])]
    mask, is_causal = attention_mask(spans, 2, torch.float32, "cpu")
    assert not is_causal and mask.shape == (2, 1, 2, 4) and mask.dtype == torch.float32
    # The second sequence's pad query (row 1) sees what its real query sees, and more: its output is dropped.
    assert visible(mask) == [[[0, 1, 2], [0, 1, 2, 3]], [[0], [0, 1]]]


def test_an_explicit_chain_is_a_chain():
    spans = [SeqSpan(start=2, num_new=3, blocks=[0], parents=[-1, 0, 1])]
    explicit, _ = attention_mask(spans, 3, torch.float32, "cpu")
    implicit, _ = attention_mask([SeqSpan(start=2, num_new=3, blocks=[0])], 3, torch.float32, "cpu")
    assert torch.equal(explicit, implicit)


def test_mask_has_the_cache_dtype():
    mask, _ = attention_mask([SeqSpan(start=5, num_new=3, blocks=[0, 1])], 3, torch.bfloat16, "cpu")
    assert mask.dtype == torch.bfloat16


def test_equal_prefills_from_the_start_use_sdpa_causal_mask():
    spans = [SeqSpan(start=0, num_new=4, blocks=[0]), SeqSpan(start=0, num_new=4, blocks=[1])]
    assert attention_mask(spans, 4, torch.float32, "cpu") == (None, True)


def test_one_query_each_at_equal_context_sees_every_key():
    spans = [SeqSpan(start=7, num_new=1, blocks=[0, 1]), SeqSpan(start=7, num_new=1, blocks=[2, 3])]
    assert attention_mask(spans, 1, torch.float32, "cpu") == (None, False)


@pytest.mark.parametrize("start", [0, 9], ids=["prefill", "verify"])
def test_a_token_tree_is_not_implemented_yet(start):
    spans = [SeqSpan(start=start, num_new=3, blocks=[0, 1, 2], parents=NOT_A_CHAIN)]
    with pytest.raises(NotImplementedError, match="tree-verification issue"):
        attention_mask(spans, 3, torch.float32, "cpu")


def test_short_query_sequences_are_grouped_by_context_length():
    contexts = [100, 120, 900, 950, 3000, 110]
    assert by_context_length(list(range(6)), contexts) == [[0, 5, 1], [2, 3], [4]]
    similar = [500, 510, 520, 530]  # padding 30 keys each is cheaper than another group
    assert by_context_length(list(range(4)), similar) == [[0, 1, 2, 3]]
    assert by_context_length([0, 1], [10, 10 + 2 * GROUP_COST_KEYS]) == [[0], [1]]
    assert by_context_length([], []) == []
