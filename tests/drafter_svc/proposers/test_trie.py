"""MindIE's memory_decoding: a frequency trie over prompts (per request) and outputs (for everyone)."""
import pytest

from drafter_svc.proposers.base import DraftRequest
from drafter_svc.proposers.trie import WARM_SHARE, TrieProposer
from drafter_svc.sequences import SequenceState


def request(tokens, prompt_length, name="s", max_tokens=16, scope="", **options):
    state = SequenceState(name)
    state.tokens, state.prompt_length, state.corpus_scope = list(tokens), prompt_length, scope
    state.options = TrieProposer.schema.resolve(options)
    return DraftRequest(state, max_tokens, state.options)


def test_the_last_two_tokens_find_what_followed_them_in_the_prompt():
    proposer = TrieProposer()
    [draft] = proposer.propose([request([1, 2, 3, 4, 9, 5, 2, 3], prompt_length=8)])
    assert draft.token_ids[:2] == (4, 9)


def test_without_a_match_for_two_tokens_the_last_one_is_looked_up():
    proposer = TrieProposer()
    [draft] = proposer.propose([request([7, 3, 4, 9, 5, 3], prompt_length=6)])  # "5 3" never occurred; "3" did
    assert draft.token_ids[:2] == (4, 9)


def test_the_most_frequent_continuation_comes_first_and_the_others_branch_off():
    proposer = TrieProposer()
    prompt = [1, 2, 3, 8, 1, 2, 3, 8, 1, 2, 4, 8, 1, 2]
    [draft] = proposer.propose([request(prompt, prompt_length=len(prompt), max_tokens=8)])
    assert draft.token_ids[0] == 3 and draft.probs[0] == pytest.approx(2 / 3)
    assert 4 in draft.token_ids and draft.parents[draft.token_ids.index(4)] == -1
    [chain] = proposer.propose([request(prompt, prompt_length=len(prompt), use_tree_spec=False)])
    assert chain.is_chain and chain.token_ids[:2] == (3, 8)


def test_a_prompt_counts_for_its_own_request_only_but_outputs_count_for_everyone():
    proposer = TrieProposer()
    first = request([50, 51, 52, 53, 60, 61, 62, 63], prompt_length=4, name="first")
    proposer.propose([first])
    # another request: the first one's output (60 61 -> 62 63) is there, its prompt (50 51 -> 52) is not
    assert proposer.propose([request([9, 60, 61], prompt_length=3, name="b")])[0].token_ids[:2] == (62, 63)
    assert not proposer.propose([request([9, 50, 51], prompt_length=3, name="c")])[0]


def test_outputs_count_only_for_requests_of_their_own_scope_and_a_warm_corpus_for_every_scope():
    proposer = TrieProposer(warm_outputs=[[30, 31, 32, 33]])
    proposer.propose([request([50, 51, 60, 61, 62, 63], prompt_length=2, name="first", scope="alice")])
    assert proposer.propose([request([9, 60, 61], 3, name="a", scope="alice")])[0].token_ids[:2] == (62, 63)
    assert not proposer.propose([request([9, 60, 61], 3, name="b", scope="bob")])[0]
    assert not proposer.propose([request([9, 60, 61], 3, name="c")])[0]
    for name, scope in (("d", ""), ("e", "alice"), ("f", "bob")):
        assert proposer.propose([request([9, 30, 31], 3, name=name, scope=scope)])[0].token_ids[:2] == (32, 33)


def test_the_bound_holds_for_every_scope_together_and_a_trim_keeps_the_warm_corpus():
    common = [5, 6, 7, 8]
    proposer = TrieProposer(max_nodes=400, warm_outputs=[[40, 41, 42, 43]])
    for i in range(40):  # outputs in two scopes, each "5 6 7 8" and then something of its own
        proposer.propose([request([1, 2, *common, 100 + i, 200 + i], prompt_length=2, name=f"r{i}",
                                  scope=("alice", "bob")[i % 2])])
    assert proposer.sizes()["trie_nodes"] <= 400
    assert proposer.propose([request([9, 5, 6], 3, name="late", scope="bob")])[0].token_ids[:2] == (7, 8)
    assert proposer.propose([request([9, 41, 42], 3, name="warm", scope="alice")])[0].token_ids[:1] == (43,)


def test_decoding_length_bounds_the_draft_and_dynamic_algo_shortens_it_after_misses():
    proposer = TrieProposer()
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10] * 3 + [1, 2]
    assert len(proposer.propose([request(text, len(text), decoding_length=4)])[0]) == 4
    missed = request(text, len(text), decoding_length=16, dynamic_algo=True)
    for _ in range(10):
        missed.sequence.acceptance.record(accepted=0, rejected=True)
    assert len(proposer.propose([missed])[0]) < 4


def test_past_its_bound_the_trie_drops_its_rarely_used_branches():
    proposer = TrieProposer(max_nodes=400)
    common = [5, 6, 7, 8]
    for i in range(40):  # every output says "5 6 7 8" and then something of its own
        proposer.propose([request([1, 2, *common, 100 + i, 200 + i], prompt_length=2, name=f"r{i}")])
    assert proposer.sizes()["trie_nodes"] <= 400
    assert proposer.propose([request([9, 5, 6], prompt_length=3, name="late")])[0].token_ids[:2] == (7, 8)


def test_a_warm_start_counts_its_outputs_for_everyone_while_they_fit_in_its_share_of_the_bound():
    common = [5, 6, 7, 8]
    proposer = TrieProposer(max_nodes=400, warm_outputs=[[*common, 100 + i, 200 + i] for i in range(40)])
    # the rest of the bound is left to what the deployment serves, before a trim has to walk the trie (the last
    # output taken in may add up to 6 + 5 + ... + 1 nodes past the share)
    assert 0 < proposer.sizes()["trie_nodes"] <= WARM_SHARE * 400 + 21
    assert proposer.propose([request([9, 5, 6], prompt_length=3)])[0].token_ids[:2] == (7, 8)
    assert proposer.propose([request([9, 8, 100], prompt_length=3)])[0].token_ids[:1] == (200,)  # the first output
    assert not proposer.propose([request([9, 8, 139], prompt_length=3)])[0]  # the last did not fit
