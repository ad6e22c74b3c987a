"""n-gram prompt lookup: the index, the acceptance estimates, and the proposer built on them."""
import random

from drafter_svc.proposers.base import DraftRequest
from drafter_svc.proposers.ngram import NgramIndex, NgramProposer, estimated_acceptance, prior_acceptance
from drafter_svc.sequences import AcceptanceHistory, SequenceState
from specd.drafts import DraftTree
from target_svc.cost_model import StepCostModel, StepShape
from target_svc.drafting.length import choose_drafts


def lookup(tokens, min_n=1, max_n=4, limit=4):
    return NgramIndex().longest_match(tokens, min_n, max_n, limit)


def test_longest_ngram_wins():
    # (2, 3) last occurred before 20, but (1, 2, 3) — a longer suffix — before 10
    match = lookup([1, 2, 3, 10, 11, 9, 2, 3, 20, 21, 1, 2, 3], limit=2)
    assert (match.length, match.continuation) == (3, [10, 11])


def test_most_recent_earlier_occurrence_wins():
    match = lookup([5, 6, 1, 5, 6, 2, 5, 6], limit=1)
    assert (match.length, match.continuation) == (2, [2])


def test_prompt_lookup_max_caps_the_ngram_length():
    match = lookup([1, 2, 3, 10, 11, 9, 2, 3, 20, 21, 1, 2, 3], max_n=2, limit=2)
    assert (match.length, match.continuation) == (2, [20, 21])


def test_prompt_lookup_min_rejects_shorter_matches():
    tokens = [7, 1, 2, 8, 9, 7]  # only the single token 7 recurs
    assert lookup(tokens, min_n=2) is None
    assert lookup(tokens, min_n=1).length == 1


def test_no_match_means_no_continuation():
    assert lookup([1, 2, 3, 4, 5]) is None
    assert lookup([]) is None


def test_continuation_is_capped_at_the_limit():
    assert lookup([1, 2, 3, 4, 5, 6, 1, 2], limit=3).continuation == [3, 4, 5]


def test_a_repeating_loop_keeps_repeating_past_the_end():
    match = lookup([7, 8, 9, 7, 8, 9], min_n=2, max_n=2, limit=5)
    assert match.continuation == [7, 8, 9, 7, 8]


def brute_force_longest_match(tokens, min_n, max_n, limit):
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n:end] == suffix:
                return n, tokens[end:end + limit]
    return None


def test_incremental_index_agrees_with_a_rescan():
    rng = random.Random(0)
    index, tokens = NgramIndex(), []
    for _ in range(400):
        tokens.extend(rng.choices(range(6), k=rng.randint(1, 3)))
        match = index.longest_match(tokens, 2, 4, limit=3)
        expected = brute_force_longest_match(tokens, 2, 4, limit=3)
        if expected is None:
            assert match is None
        else:  # the rescan stops at the end of the sequence; the index may continue a loop past it
            n, continuation = expected
            assert match.length == n and match.continuation[:len(continuation)] == continuation


def sequence(tokens):
    seq = SequenceState("s")
    seq.apply(0, tokens)
    return seq


def propose(proposer, seq, k=8, min_n=2, max_n=4) -> DraftTree:
    options = {"prompt_lookup_min": min_n, "prompt_lookup_max": max_n}
    return proposer.propose([DraftRequest(seq, k, options)])[0]


def test_proposer_drafts_what_followed_the_match_as_a_chain():
    draft = propose(NgramProposer(), sequence([1, 2, 3, 4, 5, 9, 1, 2, 3]))
    assert draft.token_ids[:2] == (4, 5)
    assert draft.is_chain and len(draft.probs) == len(draft)


def test_proposer_drafts_nothing_without_a_match():
    assert len(propose(NgramProposer(), sequence([1, 2, 3, 4, 5]))) == 0


def test_proposer_proposes_up_to_the_targets_budget_and_no_more():
    seq = sequence([1, 2, 3, 4] * 20)
    assert len(propose(NgramProposer(), seq, k=5)) == 5
    assert len(propose(NgramProposer(), seq, k=0)) == 0


def test_a_huge_prompt_lookup_max_is_served_not_refused():
    seq = sequence(list(range(40)) * 3)
    assert propose(NgramProposer(), seq, k=2, min_n=2, max_n=100_000).token_ids == (0, 1)
    assert propose(NgramProposer(), seq, k=2, min_n=100_000, max_n=100_000).token_ids == (0, 1)  # LONGEST_NGRAM


def test_proposer_answers_each_sequence_of_the_batch_in_order():
    batch = [sequence([1, 2, 3, 4, 5, 1, 2, 3]), sequence([9, 8, 7]), sequence([5, 6, 7, 5, 6])]
    options = {"prompt_lookup_min": 2, "prompt_lookup_max": 4}
    drafts = NgramProposer().propose([DraftRequest(seq, 1, options) for seq in batch])
    assert [d.token_ids for d in drafts] == [(4,), (), (7,)]


def test_proposer_reindexes_when_held_tokens_are_replaced():
    proposer, seq = NgramProposer(), sequence([1, 2, 3, 4, 1, 2, 3])
    assert propose(proposer, seq, k=1).token_ids == (4,)
    seq.apply(4, [9, 9, 2, 3, 7, 2, 3])  # the tail differs: 1, 2, 3 no longer precedes 4
    assert propose(proposer, seq, k=1).token_ids == (7,)


def test_longer_matches_are_trusted_more_at_first():
    assert [prior_acceptance(n) for n in (1, 2, 3, 5)] == sorted(prior_acceptance(n) for n in (1, 2, 3, 5))
    fresh = AcceptanceHistory()
    assert estimated_acceptance(fresh, match_length=1) < estimated_acceptance(fresh, match_length=5)


def test_a_sequence_whose_drafts_keep_matching_gets_high_estimates():
    history = AcceptanceHistory()
    for _ in range(10):
        history.record(accepted=8, rejected=False)
    assert estimated_acceptance(history, match_length=2) > 0.95


def test_estimates_fall_while_drafts_fail_and_recover_once_they_match():
    proposer, seq = NgramProposer(), sequence([1, 2, 3, 1, 2])
    fresh = iter(range(100, 10_000))
    estimates = []
    # each step the text goes on with [new token, 1, 2]: the lookup finds (1, 2) and guesses
    # the token that followed it last time, which is always wrong
    for _ in range(30):
        estimates.append(propose(proposer, seq).probs[0])
        seq.apply(len(seq.tokens), [next(fresh), 1, 2])
    assert estimates == sorted(estimates, reverse=True) and estimates[-1] < 0.05
    # then the text loops over its last three tokens, as the lookup guesses; one plain
    # step that confirms the guess raises the estimate again
    seq.apply(len(seq.tokens), [seq.tokens[-3]])
    assert propose(proposer, seq).probs[0] > estimates[-1]


def test_the_estimates_give_the_draft_lengths_the_target_verifies():
    cost = StepCostModel()  # a draft token at 4% of a one-token step
    for tokens in (1, 8, 64):
        for cached in (0, 1000):
            cost.observe(StepShape.of([(cached, tokens)]), 0.02 * (1 + 0.04 * (tokens - 1)), profile=True)
    history = AcceptanceHistory()
    lengths = []
    for _ in range(15):
        draft = DraftTree.chain([7] * 8, [estimated_acceptance(history, 3)] * 8)
        lengths.append(choose_drafts([draft], [0], cost.quiet).lengths[0])
        history.record(accepted=0, rejected=True)
    assert lengths[0] >= 2 and lengths == sorted(lengths, reverse=True) and lengths[-1] == 0
