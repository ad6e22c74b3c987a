"""eagle: the head drafts from the target's features as they arrive with the sequence updates, batched across
sequences on its own paged KV cache; its chain is what the training module computes from the same pairs."""
import pytest
import torch

from drafter_svc.proposers.base import DraftRequest
from drafter_svc.proposers.eagle import EagleProposer
from drafter_svc.proposers.ngram import prior_acceptance
from drafter_svc.sequences import FeaturesUpdate, SequenceRegistry, SequenceUpdate
from engine.features import to_bytes
from engine.runner import ModelRunner, SequenceInput
from specd.drafts import DraftTree
from tests.eagle3_reference import write_published_eagle3_head

PROMPT = [11, 400, 9000, 23, 5, 77, 1024, 3, 42, 17]


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return ModelRunner(tiny_model_dir, kv_cache_tokens=512)


def features_of(target, tokens) -> torch.Tensor:
    """The target's feature of every token [n, D]."""
    _, features = target.forward_with_features([SequenceInput("f", tokens, 0, 0)], list(range(len(tokens))))
    target.allocator.free("f")
    return features


def features_update(features: torch.Tensor, start: int) -> FeaturesUpdate:
    dtype, data = to_bytes(features[start:])
    return FeaturesUpdate(start, features.shape[1], dtype, data)


@pytest.fixture
def proposer(tiny_head, tiny_model_dir):
    return EagleProposer(str(tiny_head[0]), str(tiny_model_dir), kv_cache_tokens=256)


def sync(registry, name, tokens, features, start=0, feature_start=None, max_tokens=3, **options):
    """The target's update: tokens from `start`, features (of all but the newest token) from feature_start.
    Chains of every token the budget allows unless the options say otherwise."""
    feature_start = start if feature_start is None else feature_start
    update = SequenceUpdate(name, start, tokens[start:], features=features_update(features[:len(tokens) - 1],
                                                                                  feature_start))
    state = registry.apply(update)
    state.options = EagleProposer.schema.resolve({"use_tree_spec": False, "min_token_prob": 0.0, "with_ngram": False,
                                                  **options})
    return DraftRequest(state, max_tokens, state.options)


def module_chain(module, tokens, features, n) -> list[int]:
    """The training module's greedy chain: pairs (x_{p+1}, f_p), then its own estimates for the drafts."""
    ids, feats, chain = list(tokens[1:]), features[:len(tokens) - 1].float(), []
    with torch.no_grad():
        for _ in range(n):
            g = module(torch.tensor([ids]), feats[None])[0]
            token = int(module.draft_vocab[module.logits(g[-1]).argmax()])
            chain.append(token)
            ids, feats = ids + [token], torch.cat([feats, g[-1:]])
    return chain


def path_probs(module, tokens, features, path) -> list[float]:
    """The training module's probability of each token of `path`, drafted after `tokens` (from the head's
    own estimates past the newest token)."""
    ids, feats, probs = list(tokens[1:]), features[:len(tokens) - 1].float(), []
    with torch.no_grad():
        for token in path:
            g = module(torch.tensor([ids]), feats[None])[0]
            row = torch.softmax(module.logits(g[-1]), dim=-1)
            probs.append(float(row[(module.draft_vocab == token).nonzero()[0, 0]]))
            ids, feats = ids + [token], torch.cat([feats, g[-1:]])
    return probs


def test_every_tree_node_carries_the_heads_probability_of_it_after_its_path(proposer, tiny_head, target):
    registry = SequenceRegistry()
    features = features_of(target, PROMPT)
    [tree] = proposer.propose([sync(registry, "t", PROMPT, features, max_tokens=8, use_tree_spec=True,
                                    tree_top_k=3, max_tree_depth=4)])
    assert len(tree) == 8 and not tree.is_chain
    assert tree.token_ids[0] == module_chain(tiny_head[1], PROMPT, features.to(torch.bfloat16), 1)[0]
    for node in range(len(tree)):
        path, at = [], node
        while at != -1:
            path.insert(0, tree.token_ids[at])
            at = tree.parents[at]
        expected = path_probs(tiny_head[1], PROMPT, features.to(torch.bfloat16), path)[-1]
        assert tree.probs[node] == pytest.approx(expected, rel=1e-3)
    reaches = tree.reaches()
    assert reaches == sorted(reaches, reverse=True)  # best first


def test_the_chain_is_the_heads_greedy_chain_from_the_targets_features(proposer, tiny_head, target):
    registry = SequenceRegistry()
    features = features_of(target, PROMPT)
    [draft] = proposer.propose([sync(registry, "s", PROMPT, features)])
    assert list(draft.token_ids) == module_chain(tiny_head[1], PROMPT, features.to(torch.bfloat16), 3)
    assert draft.is_chain and all(0 < p <= 1 for p in draft.probs)


LOOPING = PROMPT + PROMPT[:4]  # ends with PROMPT's first 4 tokens: the lookup continues with PROMPT[4:]


def test_with_ngram_the_lookups_chain_joins_the_heads_draft_as_one_tree_within_the_budget(proposer, target):
    registry = SequenceRegistry()
    features = features_of(target, LOOPING)
    head_only = proposer.propose([sync(registry, "a", LOOPING, features, max_tokens=6, use_tree_spec=True)])[0]
    [merged] = proposer.propose([sync(registry, "b", LOOPING, features, max_tokens=6, use_tree_spec=True,
                                      with_ngram=True)])
    lookup = DraftTree.chain(PROMPT[4:10], [prior_acceptance(4)] * 6)  # 4 tokens matched
    assert merged == DraftTree.merge([head_only, lookup], 6)[0]
    assert merged.first_path()[:2] == PROMPT[4:6]  # a random head is far less sure than a 4-token match


def test_with_ngram_and_no_earlier_occurrence_the_draft_is_the_heads_own(proposer, target):
    registry = SequenceRegistry()
    features = features_of(target, PROMPT)
    head_only = proposer.propose([sync(registry, "a", PROMPT, features)])[0]
    assert proposer.propose([sync(registry, "b", PROMPT, features, with_ngram=True)])[0] == head_only


def test_a_head_as_eagles_authors_publish_it_drafts_its_greedy_chain_with_no_training(make_published_head,
                                                                                        tiny_model_dir, target):
    directory, module = make_published_head()
    proposer = EagleProposer(str(directory), str(tiny_model_dir), kv_cache_tokens=256)
    features = features_of(target, PROMPT)
    [draft] = proposer.propose([sync(SequenceRegistry(), "s", PROMPT, features)])
    assert list(draft.token_ids) == module_chain(module, PROMPT, features.to(torch.bfloat16), 3)


def test_an_eagle3_head_drafts_its_greedy_chain_from_the_target_layers_it_names(tiny_model_dir, target, tmp_path):
    reference = write_published_eagle3_head(tiny_model_dir, tmp_path, layers=[1, 0, 1])
    proposer = EagleProposer(str(tmp_path), str(tiny_model_dir), kv_cache_tokens=256)
    assert proposer.schema.wants_features and proposer.schema.feature_layers == (1, 0, 1)
    _, features = target.forward_with_features([SequenceInput("f", PROMPT, 0, 0)], list(range(len(PROMPT))),
                                                (1, 0, 1))
    target.allocator.free("f")
    [draft] = proposer.propose([sync(SequenceRegistry(), "s", PROMPT, features)])
    ids, hidden, chain = list(PROMPT[1:]), reference.hidden(features[:len(PROMPT) - 1].to(torch.bfloat16)), []
    with torch.no_grad():
        for _ in range(3):
            g = reference(ids, hidden)
            chain.append(int(reference.draft_vocab[reference.logits(g[-1]).argmax()]))
            ids, hidden = ids + [chain[-1]], torch.cat([hidden, g[-1:]])
    assert list(draft.token_ids) == chain


def test_after_a_step_the_accepted_tokens_features_replace_the_heads_estimates(proposer, tiny_head, target):
    registry = SequenceRegistry()
    proposer.propose([sync(registry, "s", PROMPT, features_of(target, PROMPT))])
    longer = PROMPT + [99, 7]  # two more tokens committed; the target sends the features it now knows
    features = features_of(target, longer)
    update = sync(registry, "s", longer, features, start=len(PROMPT), feature_start=len(PROMPT) - 1)
    [draft] = proposer.propose([update])
    assert list(draft.token_ids) == module_chain(tiny_head[1], longer, features.to(torch.bfloat16), 3)


def test_no_draft_until_the_features_of_every_token_but_the_newest_have_come(proposer, target):
    registry = SequenceRegistry()
    features = features_of(target, PROMPT)
    request = sync(registry, "s", PROMPT, features[:4])  # the rest of the features are still to come
    assert proposer.propose([request])[0].token_ids == ()
    rest = features_update(features[:len(PROMPT) - 1], 4)
    later = registry.apply(SequenceUpdate("s", len(PROMPT), [], features=rest))
    assert len(proposer.propose([DraftRequest(later, 3, request.options)])[0]) == 3


def test_sequences_draft_together_and_give_their_cache_back(proposer, tiny_head, target):
    registry = SequenceRegistry()
    other = [5, 6, 7, 8, 9, 5, 6]
    requests = [sync(registry, "a", PROMPT, features_of(target, PROMPT)),
                sync(registry, "b", other, features_of(target, other), max_tokens=2)]
    drafts = proposer.propose(requests)
    assert [len(d) for d in drafts] == [3, 2]
    other_features = features_of(target, other).to(torch.bfloat16)
    assert list(drafts[1].token_ids) == module_chain(tiny_head[1], other, other_features, 2)
    for request in requests:
        proposer.release(request.sequence)
    assert proposer.sizes() == {"kv_blocks_used": 0}
