"""draft_model: a draft LM (here the tiny model, whole or its first layer) proposes its greedy chain,
batched across sequences on its own paged KV cache, which follows what the target kept."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from drafter_svc.proposers.base import DraftRequest
from drafter_svc.proposers.draft_model import DraftModelProposer
from drafter_svc.sequences import SequenceState

PROMPT = [11, 400, 9000, 23, 5, 77, 1024, 3]


def request(tokens, name="s", max_tokens=4, **options):
    """Chains of every token the budget allows unless the options say otherwise."""
    state = SequenceState(name)
    state.tokens = list(tokens)
    state.options = DraftModelProposer.schema.resolve({"min_token_prob": 0.0, **options})
    return DraftRequest(state, max_tokens, state.options)


def greedy(model_dir, tokens, n, num_layers=None) -> list[int]:
    """transformers' greedy continuation of `tokens`, n tokens, no cache."""
    extra = {} if num_layers is None else {"num_hidden_layers": num_layers}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **extra).eval()
    ids = list(tokens)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(tokens):]


@pytest.fixture(scope="module")
def proposer(tiny_model_dir):
    return DraftModelProposer(str(tiny_model_dir), kv_cache_tokens=256)


def test_the_draft_is_the_draft_models_greedy_chain_with_its_probabilities(proposer, tiny_model_dir):
    [draft] = proposer.propose([request(PROMPT, max_tokens=5)])
    assert list(draft.token_ids) == greedy(tiny_model_dir, PROMPT, 5)
    assert draft.is_chain and all(0 < p <= 1 for p in draft.probs)
    proposer.release(request(PROMPT).sequence)


def test_the_first_layers_alone_are_the_self_speculative_draft(tiny_model_dir):
    early = DraftModelProposer(str(tiny_model_dir), num_layers=1, kv_cache_tokens=64)
    [draft] = early.propose([request(PROMPT, max_tokens=3)])
    assert list(draft.token_ids) == greedy(tiny_model_dir, PROMPT, 3, num_layers=1)


def test_after_the_target_keeps_part_of_a_draft_the_next_draft_is_as_from_scratch(proposer, tiny_model_dir):
    first = request(PROMPT, name="kept", max_tokens=4)
    [draft] = proposer.propose([first])
    # The target kept two draft tokens, then emitted its own next token (not the third draft).
    first.sequence.apply(len(PROMPT), [*draft.token_ids[:2], draft.token_ids[2] + 1])
    [next_draft] = proposer.propose([first])
    assert list(next_draft.token_ids) == greedy(tiny_model_dir, first.sequence.tokens, 4)
    proposer.release(first.sequence)


def test_sequences_of_different_lengths_and_budgets_draft_together(proposer, tiny_model_dir):
    long, short = request(PROMPT * 3, name="long", max_tokens=4), request(PROMPT[:3], name="short", max_tokens=2)
    drafts = proposer.propose([long, short])
    assert [list(d.token_ids) for d in drafts] == [greedy(tiny_model_dir, PROMPT * 3, 4),
                                                   greedy(tiny_model_dir, PROMPT[:3], 2)]
    for r in (long, short):
        proposer.release(r.sequence)


def test_min_token_prob_ends_the_chain_where_its_path_becomes_unlikely(proposer):
    [full] = proposer.propose([request(PROMPT, name="a", max_tokens=6)])
    reaches = full.reaches()  # the probabilities multiplied down the chain
    cut_at = (reaches[2] + reaches[3]) / 2
    [cut] = proposer.propose([request(PROMPT, name="b", max_tokens=6, min_token_prob=cut_at)])
    assert cut.token_ids == full.token_ids[:4]  # the fourth token is the first below: drafted, then the end


def test_an_index_only_ask_prefills_and_a_bad_token_gets_no_draft_but_the_batch_goes_on(proposer):
    assert proposer.propose([request(PROMPT, name="prefill", max_tokens=0)])[0].token_ids == ()
    drafts = proposer.propose([request([*PROMPT, 49152], name="bad"), request(PROMPT, name="good")])
    assert drafts[0].token_ids == () and len(drafts[1].token_ids) == 4


def test_released_sequences_give_their_kv_blocks_back_and_a_full_cache_costs_drafts_not_errors(tiny_model_dir):
    small = DraftModelProposer(str(tiny_model_dir), kv_cache_tokens=32)
    a, b = request(PROMPT * 2, name="a"), request(PROMPT * 2, name="b")
    assert len(small.propose([a])[0]) == 4
    # b does not fit beside a: a (not in this step) gives its blocks up
    assert len(small.propose([b])[0]) == 4
    small.release(b.sequence)
    assert small.sizes() == {"kv_blocks_used": 0}
    assert small.propose([request(PROMPT * 5, name="too-long")])[0].token_ids == ()
