"""Lookahead decoding: a Jacobi window that rides in the target's forward feeds an n-gram pool whose
continuations of the newest token are the draft; greedy output never changes."""
import asyncio

import pytest

from specd.drafts import ROOT
from specd.types import SamplingParams, SpeculativeConfig
from target_svc.cost_model import StepCostModel, StepShape
from target_svc.drafting.lookahead import ACCEPTANCE_ESTIMATE, PRIOR_YIELD, LookaheadSource, _Lookahead
from target_svc.sequence import Sequence
from tests.target_svc.test_scheduler import bf16_scheduler, prompt_of, run_to_end, sequence


def lookahead(level=4, width=3, guess_set_size=2, levels=None) -> _Lookahead:
    return _Lookahead(level, width, guess_set_size, levels or [[10, 11, 12]])


def test_the_window_is_a_tree_whose_columns_climb_the_levels_from_a_chain_at_level_zero():
    state = lookahead(levels=[[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    window = state.window(prior_yield=1.0)
    assert window.token_ids == (10, 11, 12, 20, 21, 22, 30, 31, 32)
    # level 0 is a chain from the newest token; (l, j) follows (l - 1, j)
    assert window.parents == (ROOT, 0, 1, 0, 1, 2, 3, 4, 5)
    # so (l, j) sits l + j + 1 places past the newest token: its argmax guesses the place after that
    assert window.depths() == [1, 2, 3, 2, 3, 4, 3, 4, 5]
    assert window.guess_nodes == (6, 7, 8)


def test_the_window_grows_a_level_a_step_then_turns_its_columns_into_n_grams_and_moves_up():
    state = lookahead()
    state.advance([20, 21, 22])
    state.advance([30, 31, 32])
    assert state.levels == [[10, 11, 12], [20, 21, 22], [30, 31, 32]] and not state.pool
    state.advance([40, 41, 42])  # level - 1 = 3 levels are full: each column and its guess is a 4-gram
    assert state.levels == [[20, 21, 22], [30, 31, 32], [40, 41, 42]]
    assert {key: list(pool) for key, pool in state.pool.items()} == {
        10: [(20, 30, 40)], 11: [(21, 31, 41)], 12: [(22, 32, 42)]}
    assert all(from_window for pool in state.pool.values() for from_window in pool.values())


def test_the_pool_keeps_the_latest_guess_set_size_continuations_of_each_token_and_the_texts_own():
    state = lookahead(level=3, guess_set_size=2)
    state.index_text([1, 2, 3, 1, 2, 4, 1, 5, 6])
    assert list(state.pool[1]) == [(2, 4), (5, 6)]  # (2, 3) was the oldest of three
    assert not any(state.pool[1].values())  # from the text, not the window
    state.index_text([1, 2, 3, 1, 2, 4, 1, 5, 6, 1, 2])  # only the new tokens' n-grams are added
    assert list(state.pool[1]) == [(2, 4), (5, 6)] and list(state.pool[6]) == [(1, 2)]


def test_a_full_pool_drops_the_windows_oldest_guess_before_anything_the_text_said():
    state = lookahead(level=3, guess_set_size=2)
    state.remember((1, 7, 7), from_window=True)
    state.remember((1, 2, 3), from_window=False)
    state.remember((1, 8, 8), from_window=True)  # (7, 7) goes, though (2, 3) is older
    assert dict(state.pool[1]) == {(2, 3): False, (8, 8): True}
    state.index_text([1, 8, 8])  # the text says (8, 8) too: no longer a guess
    assert dict(state.pool[1]) == {(2, 3): False, (8, 8): False}


def test_a_draft_merges_the_continuations_into_one_tree_newest_first_with_estimates_shared_by_count():
    state = lookahead(level=4, guess_set_size=3)
    for continuation in [(7, 8, 9), (7, 8, 6), (5, 4, 3)]:
        state.remember((1, *continuation), from_window=continuation == (5, 4, 3))
    draft = state.draft(1, k=16)
    paths = {}
    for token, parent in zip(draft.token_ids, draft.parents):
        paths[len(paths)] = (*(paths[parent] if parent != ROOT else ()), token)
    assert set(paths.values()) == {(7,), (7, 8), (7, 8, 9), (7, 8, 6), (5,), (5, 4), (5, 4, 3)}  # (7, 8) once
    assert draft.probs[draft.token_ids.index(7)] == pytest.approx(ACCEPTANCE_ESTIMATE * 2 / 3)
    assert sum(draft.reaches()[i] for i, p in enumerate(draft.parents) if p == ROOT) <= 1.0
    # best first: a cut to k nodes keeps the likeliest, and is still a tree
    assert draft.token_ids[:2] == (7, 5) and state.draft(1, k=3).token_ids == (7, 5, 8)
    assert state.last_draft_from_window == (False, True, False)
    assert not state.draft(99, k=16)


def test_the_window_is_expected_to_bring_what_its_n_grams_brought_per_step_it_ran():
    source, seq = LookaheadSource(), sequence("s", prompt=[1, 2, 3, 4])
    asyncio.run(source.propose([(seq, 4)]))
    state = source._states["s"]
    prior = source.window(seq).expected_yield
    for _ in range(32):  # it runs and its n-grams bring nothing
        state.last_draft_from_window = (True, True)
        source.observe(seq, [9, 9, 9, 9, 9], num_verified=2, accepted_nodes=())
    assert source.window(seq).expected_yield < prior / 4
    for _ in range(64):  # drafts from its n-grams are accepted two tokens a step
        state.last_draft_from_window = (True, True)
        source.observe(seq, [9, 9, 9, 9, 9], num_verified=2, accepted_nodes=(0, 1))
    assert source.window(seq).expected_yield == pytest.approx(2.0, rel=0.1)
    source.release(seq)
    assert source.window(seq) is None


def test_a_new_sequences_window_is_expected_to_bring_what_windows_brought_the_deployments_sequences():
    source = LookaheadSource()
    first, later = sequence("first", prompt=[1, 2, 3, 4]), sequence("later", prompt=[5, 6, 7, 8])
    asyncio.run(source.propose([(first, 4)]))
    assert source.window(first).expected_yield == PRIOR_YIELD  # no window has run on the deployment yet
    for _ in range(64):  # the first sequence's windows run and bring nothing
        source._states["first"].last_draft_from_window = (True,)
        source.observe(first, [9, 9, 9, 9, 9], num_verified=1, accepted_nodes=())
    source.release(first)
    asyncio.run(source.propose([(later, 4)]))
    assert source.window(later).expected_yield < PRIOR_YIELD / 2  # so the next one's is not run on trust


def cost_model(per_token: float) -> StepCostModel:
    """A cost model fixed at 10 ms a step and `per_token` seconds a new token (steps do not move it)."""
    cost = StepCostModel()
    for tokens in (1, 16, 64):
        for cached in (0, 1024):
            cost.observe(StepShape.of([(cached, tokens)]), 0.010 + per_token * tokens, profile=True)
    cost.observe = lambda shape, seconds, profile=False: None
    return cost


def kneed_cost_model(knee: int, per_token_past: float) -> StepCostModel:
    """A cost model whose steps cost 10 ms up to `knee` new tokens and `per_token_past` seconds each past it."""
    cost = StepCostModel()
    for tokens in (1, 2, 4, 8, 16, 32, 64):
        cost.observe(StepShape.of([(16, tokens)]), 0.010 + per_token_past * max(0, tokens - knee), profile=True)
    cost.observe = lambda shape, seconds, profile=False: None
    return cost


def window_tokens(scheduler, outcome: str) -> float:
    return scheduler._metrics.registry.get_sample_value("specd_window_tokens_total", {"outcome": outcome}) or 0.0


LOOKAHEAD = SpeculativeConfig(method="lookahead", num_speculative_tokens=6,
                              options={"lookahead_level": 4, "lookahead_window": 4, "lookahead_guess_set_size": 4})


async def generate_all(scheduler, prompts, speculative, **sampling):
    seqs = [Sequence(f"s{i}", p, SamplingParams(max_tokens=40, **sampling), speculative, 40, eos_token_ids=frozenset())
            for i, p in enumerate(prompts)]
    return await asyncio.gather(*(run_to_end(scheduler, s) for s in seqs)), seqs


PROMPTS = [prompt_of(50 + i, 12 + 7 * i) for i in range(3)]


async def test_greedy_lookahead_with_its_window_running_is_token_for_token_plain_decoding(tiny_model_dir):
    async with bf16_scheduler(tiny_model_dir) as scheduler:
        expected = await asyncio.gather(*(run_to_end(scheduler, sequence(f"p{i}", p, max_tokens=40))
                                          for i, p in enumerate(PROMPTS)))
    async with bf16_scheduler(tiny_model_dir, sources=[LookaheadSource()], cost_model=cost_model(1e-6)) as scheduler:
        got, seqs = await generate_all(scheduler, PROMPTS, LOOKAHEAD)
        assert got == expected
        assert window_tokens(scheduler, "ran") > 0
        assert sum(s.usage.accepted_draft_tokens for s in seqs) > 0  # a random model loops: the pool catches it
        assert scheduler._runner.allocator.num_free_blocks == scheduler._runner.allocator.num_blocks


async def test_where_its_tokens_cost_what_a_step_does_the_window_never_runs_and_output_is_the_same(tiny_model_dir):
    async with bf16_scheduler(tiny_model_dir, sources=[LookaheadSource()], cost_model=cost_model(1e-6)) as scheduler:
        cheap, _ = await generate_all(scheduler, PROMPTS, LOOKAHEAD)
    async with bf16_scheduler(tiny_model_dir, sources=[LookaheadSource()], cost_model=cost_model(0.010)) as scheduler:
        dear, _ = await generate_all(scheduler, PROMPTS, LOOKAHEAD)
        assert dear == cheap
        assert window_tokens(scheduler, "ran") == 0
        assert window_tokens(scheduler, "skipped") > 0


async def test_a_window_is_priced_past_the_knee_its_own_tokens_carry_the_step_to(tiny_model_dir):
    # Below 4 new tokens a step costs the same: priced at the step's size before it, a window of a dozen
    # tokens on a batch-1 step would look free; its tokens past the fourth cost a step's worth each.
    cost = kneed_cost_model(knee=4, per_token_past=0.010)
    assert cost.quiet.knees == (4,)
    async with bf16_scheduler(tiny_model_dir, sources=[LookaheadSource()], cost_model=cost) as scheduler:
        await generate_all(scheduler, PROMPTS[:1], LOOKAHEAD)
        assert window_tokens(scheduler, "ran") == 0
        assert window_tokens(scheduler, "skipped") > 0


async def test_sampled_lookahead_runs_its_window_and_a_seeded_request_is_reproducible(tiny_model_dir):
    async with bf16_scheduler(tiny_model_dir, sources=[LookaheadSource()], cost_model=cost_model(1e-6)) as scheduler:
        first, _ = await generate_all(scheduler, PROMPTS, LOOKAHEAD, temperature=0.8, seed=7)
        again, _ = await generate_all(scheduler, PROMPTS, LOOKAHEAD, temperature=0.8, seed=7)
        assert first == again and all(len(tokens) == 40 for tokens in first)
        assert window_tokens(scheduler, "ran") > 0
