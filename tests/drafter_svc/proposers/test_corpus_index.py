"""The warm corpus as a suffix array: every node, count and continuation a counting suffix tree of the same
texts has, worked out when asked."""
import random

import pytest

from drafter_svc.proposers.corpus_index import CorpusIndex
from drafter_svc.proposers.suffix_tree import SuffixTree


def random_texts(rng: random.Random, count: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 60))] for _ in range(count)]


@pytest.mark.parametrize("seed", range(3))
def test_every_substring_has_the_trees_count_and_continuations(seed):
    rng = random.Random(seed)
    texts = random_texts(rng, 40, vocab=5)
    tree, index = SuffixTree(depth=6), CorpusIndex(texts, depth=6)
    for tokens in texts:
        tree.add(tokens)
    for _ in range(500):
        text = rng.choice(texts)
        start = rng.randrange(len(text))
        substring = text[start:start + rng.randint(1, 7)]
        in_tree, in_index = tree.node(substring), index.node(substring)
        assert (in_tree is None) == (in_index is None)
        if in_tree is None:  # deeper than the tree
            continue
        assert in_index.count == in_tree.count
        total, children = in_index.continuations(0.0)
        assert total == sum(child.count for child in (in_tree.children or {}).values())
        assert {token: child.count for token, child in children} == \
            {token: child.count for token, child in (in_tree.children or {}).items()}


def test_a_share_leaves_out_the_rarer_continuations_but_not_the_total():
    index = CorpusIndex([[1, 2], [1, 2], [1, 2], [1, 3], [1, 4], [1, 4]], depth=4)
    total, children = index.node([1]).continuations(1 / 3)
    assert total == 6 and [(token, child.count) for token, child in children] == [(2, 3), (4, 2)]
    assert [token for token, _ in index.node([1]).continuations(0.5)[1]] == [2]


def test_no_substring_runs_from_one_text_into_the_next():
    index = CorpusIndex([[1, 2], [3, 4]], depth=4)
    assert index.node([2, 3]) is None
    assert index.node([2]).continuations(0.0) == (0, [])  # a text's last token: nothing follows it
    assert index.num_tokens == 4


def test_matches_are_every_suffix_of_the_context_found_in_the_corpus():
    index = CorpusIndex([[5, 6, 7, 8]], depth=24)
    assert [(n, node.count) for n, node in index.matches([9, 6, 7], longest=8)] == [(1, 1), (2, 1)]
    assert index.matches([9, 6, 7], longest=1)[0][0] == 1
    assert not index.matches([9], longest=8) and not CorpusIndex([], depth=4).matches([1], longest=4)
