"""n-gram prompt lookup: the index, and the proposer built on it."""
import random

from drafter_svc.draft_length import DraftLengthPolicy
from drafter_svc.ngram import NgramIndex, NgramProposer
from drafter_svc.proposer import DraftParams
from drafter_svc.sequences import SequenceState


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


def propose(proposer, seq, k=8, min_n=2, max_n=4):
    return proposer.propose([(seq, DraftParams(k, min_n, max_n))])[0]


def test_proposer_drafts_what_followed_the_match():
    proposer = NgramProposer(DraftLengthPolicy())
    assert propose(proposer, sequence([1, 2, 3, 4, 5, 9, 1, 2, 3]))[:2] == [4, 5]


def test_proposer_drafts_nothing_without_a_match():
    proposer = NgramProposer(DraftLengthPolicy())
    assert propose(proposer, sequence([1, 2, 3, 4, 5])) == []


def test_proposer_never_drafts_more_than_k():
    proposer = NgramProposer(DraftLengthPolicy(draft_token_cost=0.0))  # free verification: draft all it can
    seq = sequence([1, 2, 3, 4] * 20)
    assert len(propose(proposer, seq, k=5)) == 5
    assert propose(proposer, seq, k=0) == []


def test_a_huge_prompt_lookup_max_is_served_not_refused():
    proposer = NgramProposer(DraftLengthPolicy())
    seq = sequence(list(range(40)) * 3)
    assert propose(proposer, seq, k=2, min_n=2, max_n=100_000) == [0, 1]
    assert propose(proposer, seq, k=2, min_n=100_000, max_n=100_000) == [0, 1]  # as LONGEST_NGRAM-grams


def test_proposer_answers_each_sequence_of_the_batch_in_order():
    proposer = NgramProposer(DraftLengthPolicy())
    batch = [sequence([1, 2, 3, 4, 5, 1, 2, 3]), sequence([9, 8, 7]), sequence([5, 6, 7, 5, 6])]
    drafts = proposer.propose([(seq, DraftParams(1, 2, 4)) for seq in batch])
    assert drafts == [[4], [], [7]]


def test_proposer_reindexes_when_held_tokens_are_replaced():
    proposer = NgramProposer(DraftLengthPolicy())
    seq = sequence([1, 2, 3, 4, 1, 2, 3])
    assert propose(proposer, seq, k=1) == [4]
    seq.apply(4, [9, 9, 2, 3, 7, 2, 3])  # the tail differs: 1, 2, 3 no longer precedes 4
    assert propose(proposer, seq, k=1) == [7]


def test_proposer_stops_drafting_when_drafts_keep_failing_and_resumes_when_they_match():
    proposer = NgramProposer(DraftLengthPolicy(draft_token_cost=0.04))  # cheap verification: resumes after one hit
    seq = sequence([1, 2, 3])
    fresh = iter(range(100, 10_000))
    # each step the text goes on with [new token, 1, 2]: the lookup finds (1, 2) and guesses
    # the token that followed it last time, which is always wrong
    for _ in range(30):
        propose(proposer, seq)
        seq.apply(len(seq.tokens), [next(fresh), 1, 2])
    assert propose(proposer, seq) == []
    # then the text loops over its last three tokens, as the lookup guesses; one plain
    # step that confirms the guess brings the drafts back
    seq.apply(len(seq.tokens), [seq.tokens[-3]])
    assert propose(proposer, seq) != []
