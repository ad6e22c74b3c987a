"""Suffix decoding: the counting suffix tree, the best-first expansion, and the proposer's trees and corpus."""
import random

import pytest

from drafter_svc.proposers.base import DraftRequest
from drafter_svc.proposers.suffix import SuffixProposer, trusted
from drafter_svc.proposers.suffix_tree import TREE_DEPTH, SuffixTree, speculate
from drafter_svc.proposers.text_index import TextIndex
from drafter_svc.sequences import SequenceState
from specd.drafts import DraftTree


def count(tree: SuffixTree, substring: list[int]) -> int:
    node = tree.node(substring)
    return node.count if node is not None else 0


def test_the_tree_counts_every_substring_up_to_its_depth():
    tree = SuffixTree(depth=3)
    tree.add([1, 2, 1, 2, 3])
    assert count(tree, [1]) == 2 and count(tree, [1, 2]) == 2 and count(tree, [2, 1, 2]) == 1
    assert count(tree, [1, 2, 3]) == 1 and count(tree, [2, 3]) == 1
    assert count(tree, [1, 2, 1, 2]) == 0  # deeper than the tree


def test_removing_a_text_uncounts_it_and_drops_what_only_it_held():
    tree = SuffixTree(depth=4)
    tree.add([1, 2, 3])
    nodes = tree.num_nodes
    tree.add([1, 2, 4])
    tree.remove([1, 2, 4])
    assert tree.num_nodes == nodes and count(tree, [1, 2]) == 1 and count(tree, [2, 4]) == 0
    tree.remove([1, 2, 3])
    assert tree.num_nodes == 0 and not tree.root.children


def test_matches_are_every_suffix_of_the_text_found_in_the_tree():
    tree = SuffixTree()
    tree.add([5, 6, 7, 8])
    assert [n for n, _ in tree.matches([9, 6, 7], longest=8)] == [1, 2]
    assert tree.matches([9, 6, 7], longest=1)[0][1] is tree.root.children[7]


def test_continuations_are_proposed_best_first_with_their_count_shares():
    tree = SuffixTree()
    for text in ([1, 2, 3], [1, 2, 3], [1, 2, 4], [1, 5]):
        tree.add(text)
    found = speculate(tree.root.children[1], budget=8, min_token_prob=0.1, tree_mode=True, max_depth=8)
    draft = found.draft
    # after 1: 2 three times in four, 5 once; after 1 2: 3 twice in three, 4 once
    assert draft.token_ids == (2, 3, 5, 4) and draft.parents == (-1, 0, -1, 0)  # ties: first offered first
    assert draft.reaches() == pytest.approx([0.75, 0.5, 0.25, 0.25])
    assert found.score == pytest.approx(1.75)


def test_path_mode_follows_the_likeliest_child_and_unlikely_paths_are_not_drafted():
    tree = SuffixTree()
    for text in ([1, 2, 3], [1, 2, 3], [1, 2, 4], [1, 5]):
        tree.add(text)
    chain = speculate(tree.root.children[1], budget=8, min_token_prob=0.1, tree_mode=False, max_depth=8).draft
    assert chain.token_ids == (2, 3) and chain.is_chain
    likely = speculate(tree.root.children[1], budget=8, min_token_prob=0.4, tree_mode=True, max_depth=8).draft
    assert likely.token_ids == (2, 3)  # 4 and 5 are a quarter likely


def request(tokens, prompt_length=0, max_tokens=8, scope="", **options):
    state = SequenceState("s")
    state.tokens, state.prompt_length, state.corpus_scope = list(tokens), prompt_length, scope
    state.options = SuffixProposer.schema.resolve(options)
    return DraftRequest(state, max_tokens, state.options)


def test_a_request_is_drafted_from_its_own_text():
    proposer = SuffixProposer()
    [draft] = proposer.propose([request([7, 1, 2, 3, 4, 5, 9, 1, 2, 3])])
    assert draft.token_ids == (4, 5, 9)  # after "1 2 3": a 3-token match earns up to 3 tokens


def test_a_draft_token_is_trusted_more_the_longer_the_match_behind_it_and_more_in_the_requests_own_text():
    proposer = SuffixProposer()
    # Seen once after "1 2 3": share 1, backed by 3, 4 and 5 matched tokens of the request's own text.
    [long_match] = proposer.propose([request([7, 1, 2, 3, 4, 5, 9, 1, 2, 3])])
    assert long_match.token_ids == (4, 5, 9)
    assert long_match.probs == pytest.approx([3 / 3.65, 4 / 4.65, 5 / 5.65])
    [short_match] = proposer.propose([request([7, 1, 8, 9, 1])])
    assert short_match.token_ids == (8,) and short_match.probs == pytest.approx([1 / 1.65])
    # The same share and match in an earlier request's output is trusted less.
    proposer.release(request([40, 10, 11, 12, 13], prompt_length=1).sequence)
    [from_output] = proposer.propose([request([1, 2, 10, 11])])
    assert from_output.token_ids == (12, 13) and from_output.probs == pytest.approx([2 / 4, 3 / 5])
    [own] = SuffixProposer().propose([request([5, 10, 11, 12, 6, 10, 11])])
    assert own.token_ids == (12, 6) and own.probs == pytest.approx([2 / 2.65, 3 / 3.65])


def test_a_longer_match_earns_a_longer_draft_and_the_budget_follows_the_options():
    text = [7, 1, 2, 3, 4, 5, 6, 9, 3]
    proposer = SuffixProposer()
    assert len(proposer.propose([request(text)])[0]) == 1  # one matched token: one draft token
    assert len(proposer.propose([request(text, max_spec_offset=3)])[0]) == 4
    assert len(proposer.propose([request(text, max_spec_offset=3, max_tokens=2)])[0]) == 2


def test_outputs_of_finished_requests_draft_for_later_ones_but_their_prompts_do_not():
    proposer = SuffixProposer()
    finished = request([40, 41, 42, 10, 11, 12, 13, 14, 15], prompt_length=3).sequence
    proposer.release(finished)
    assert proposer.sizes()["global_tree_requests"] == 1
    [draft] = proposer.propose([request([1, 2, 10, 11, 12])])
    assert draft.token_ids[:3] == (13, 14, 15)
    assert not proposer.propose([request([1, 2, 40, 41])])[0]  # the prompt stayed out


def test_the_global_tree_keeps_only_the_newest_outputs():
    proposer = SuffixProposer(max_cached_requests=2)
    for first in (10, 20, 30):
        proposer.release(request([first, first + 1, first + 2]).sequence)
    assert proposer.sizes()["global_tree_requests"] == 2
    assert not proposer.propose([request([5, 10, 11])])[0]  # the oldest went
    assert proposer.propose([request([5, 30, 31])])[0].token_ids == (32,)
    assert not SuffixProposer(max_cached_requests=0).sizes()["global_tree_nodes"]


def test_outputs_draft_only_for_requests_of_their_own_scope():
    proposer = SuffixProposer()
    proposer.release(request([1, 10, 11, 12, 13], prompt_length=1, scope="alice").sequence)
    assert proposer.propose([request([5, 10, 11], scope="alice")])[0].token_ids == (12, 13)
    assert not proposer.propose([request([5, 10, 11], scope="bob")])[0]
    assert not proposer.propose([request([5, 10, 11])])[0]  # the common scope is a scope like the others
    assert proposer.sizes()["corpus_scopes"] == 1


def test_the_newest_outputs_of_every_scope_together_are_kept():
    proposer = SuffixProposer(max_cached_requests=2)
    for first, scope in ((10, "alice"), (20, "bob"), (30, "bob")):
        proposer.release(request([first, first + 1, first + 2], scope=scope).sequence)
    assert not proposer.propose([request([5, 10, 11], scope="alice")])[0]  # the oldest went, its scope with it
    assert proposer.sizes() | {"corpus_tokens": 0} == {"global_tree_requests": 2, "corpus_scopes": 1,
                                                        "global_tree_nodes": 12, "corpus_tokens": 0}
    assert proposer.propose([request([5, 20, 21], scope="bob")])[0].token_ids == (22,)


def test_a_warm_corpus_drafts_for_every_scope():
    proposer = SuffixProposer(warm_outputs=[[10, 11, 12, 13]])
    for scope in ("", "alice", "bob"):
        assert proposer.propose([request([1, 10, 11], scope=scope)])[0].token_ids == (12, 13)


def test_a_warm_corpus_drafts_as_finished_requests_would_and_what_is_served_does_not_push_it_out():
    proposer = SuffixProposer(max_cached_requests=1, warm_outputs=[[10, 11, 12, 13], [20, 21, 22, 23]])
    assert proposer.sizes()["corpus_tokens"] == 8 and proposer.sizes()["global_tree_requests"] == 0
    assert proposer.propose([request([1, 2, 20, 21, 22], prompt_length=2)])[0].token_ids == (23,)
    for first in (30, 40):
        proposer.release(request([5, first, first + 1, first + 2], prompt_length=1).sequence)
    assert proposer.sizes()["global_tree_requests"] == 1
    assert proposer.propose([request([5, 10, 11])])[0].token_ids == (12, 13)


@pytest.mark.parametrize("options", [{}, {"use_tree_spec": False}, {"max_spec_offset": 3, "min_token_prob": 0.05}])
def test_a_corpus_drafts_what_a_global_tree_of_the_same_outputs_drafts(options):
    rng = random.Random(0)
    outputs = [[rng.randrange(6) for _ in range(rng.randint(1, 40))] for _ in range(30)]
    from_corpus, from_outputs = SuffixProposer(warm_outputs=outputs), SuffixProposer()
    for output in outputs:
        from_outputs.release(request([99, *output], prompt_length=1).sequence)
    for _ in range(200):
        context = [99, *(rng.randrange(6) for _ in range(rng.randint(1, 12)))]
        assert from_corpus.propose([request(context, **options)]) == from_outputs.propose([request(context, **options)])


def best_of_every_match(proposer: SuffixProposer, tokens: list[int], max_tokens: int, options: dict):
    """What the proposer must draft: every match expanded, the best score winning, the first listed on a tie."""
    local = TextIndex(TREE_DEPTH)
    local.sync(tokens)
    matches = [*(("own", n, node) for n, node in local.matches(tokens, TREE_DEPTH)),
               *(("other", n, node) for tree in (proposer.outputs_tree(""), proposer.corpus)
                 for n, node in tree.matches(tokens, TREE_DEPTH))]
    best, best_match = None, None
    for where, n, node in matches:
        budget = min(max_tokens, int(n * options["max_spec_factor"] + options["max_spec_offset"]))
        found = speculate(node, budget, options["min_token_prob"], options["use_tree_spec"], TREE_DEPTH)
        if budget > 0 and found.score > (best.score if best else 0.0):
            best, best_match = found, (where, n)
    return trusted(best.draft, *best_match) if best else DraftTree()


@pytest.mark.parametrize("options", [{}, {"use_tree_spec": False}, {"max_spec_offset": 3, "min_token_prob": 0.05}])
def test_matches_that_cannot_win_are_not_expanded_and_the_draft_is_that_of_every_match_expanded(options):
    rng = random.Random(1)
    proposer = SuffixProposer(warm_outputs=[[rng.randrange(5) for _ in range(30)] for _ in range(10)])
    for _ in range(10):
        proposer.release(request([99, *(rng.randrange(5) for _ in range(30))], prompt_length=1).sequence)
    resolved = SuffixProposer.schema.resolve(options)
    for _ in range(200):
        tokens = [rng.randrange(5) for _ in range(rng.randint(1, 40))]
        max_tokens = rng.randint(1, 12)
        [draft] = proposer.propose([request(tokens, max_tokens=max_tokens, **options)])
        assert draft == best_of_every_match(proposer, tokens, max_tokens, resolved)


def test_it_asks_for_whole_outputs_only_while_it_keeps_them():
    assert SuffixProposer().schema.learns_outputs
    assert not SuffixProposer(max_cached_requests=0).schema.learns_outputs  # nothing learns from them


def test_a_request_holding_its_text_grows_its_tree_as_tokens_arrive():
    proposer = SuffixProposer()
    req = request([7, 1, 2, 3, 9])
    proposer.propose([req])
    req.sequence.tokens += [1, 2]
    [draft] = proposer.propose([req])
    assert draft.token_ids == (3, 9)
