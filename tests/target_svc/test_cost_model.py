"""The step cost model: fitted to what steps measured, at start-up and online."""
from collections import Counter

import pytest

from target_svc import cost_model
from target_svc.cost_model import (PROFILE_REPEATS, SMALL_STEP_REPEATS, SMALL_STEP_TOKENS, Coefficients,
                                   StepCostModel, StepShape, attention_pairs, features)
from engine.runner import ModelRunner


def one(cached: int, new: int) -> StepShape:
    """A step of one sequence: `new` tokens after `cached` ones."""
    return StepShape.of([(cached, new)])


def test_a_step_is_shaped_by_its_new_tokens_the_lengths_they_reach_and_their_query_key_pairs():
    shape = StepShape.of([(100, 1), (0, 4)])  # a decode at 100 tokens; a 4-token prompt
    assert shape == StepShape(tokens=5, context=101 + 4, pairs=101 + (1 + 2 + 3 + 4))
    assert attention_pairs(10, 3) == 11 + 12 + 13


def test_it_recovers_a_linear_cost_from_measured_steps():
    model = StepCostModel()
    truth = Coefficients(fixed=0.01, per_token=0.0004, per_token_past_first_knee=0.0, per_token_past_second_knee=0.0,
                         per_context=0.000002, per_pair=0.0000003)
    for cached, new in [(0, 1), (0, 32), (4000, 1), (1000, 256), (8000, 8), (2000, 64)]:
        shape = one(cached, new)
        model.observe(shape, sum(c * x for c, x in zip(truth, features(shape, knees=()))), profile=True)
    assert model.knees == ()
    assert model.coefficients == pytest.approx(truth, rel=1e-3, abs=1e-9)
    shape = one(490, 10)
    assert model.predict(shape) == pytest.approx(0.01 + 0.004 + 0.001 + 0.0000003 * shape.pairs, rel=1e-3)


def test_a_step_whose_first_tokens_ride_nearly_free_is_fitted_with_its_knee():
    # Up to 8 new tokens a step reads its weights and little else; past them each token costs its arithmetic.
    def measured(shape: StepShape) -> float:
        return 0.01 + 0.0001 * shape.tokens + 0.0009 * max(0, shape.tokens - 8) + 0.0000003 * shape.pairs

    model = StepCostModel()
    for cached in (16, 256):
        for new in (1, 2, 4, 8, 16, 32, 64, 128):
            model.observe(one(cached, new), measured(one(cached, new)), profile=True)
    assert model.knees == (8,)
    for new in (1, 3, 8, 20, 100):
        assert model.predict(one(300, new)) == pytest.approx(measured(one(300, new)), rel=1e-3)
    # So a one-sequence step's first draft tokens are priced at what they add, a tenth of a full token.
    assert model.token_seconds(300, step_tokens=1) == pytest.approx(0.0001 + 0.0000003 * 301, rel=1e-2)
    assert model.token_seconds(300, step_tokens=16) == pytest.approx(0.001 + 0.0000003 * 301, rel=1e-2)


def test_a_small_steps_next_token_is_priced_at_what_the_profile_measured_it_to_add():
    # A kernel change at 7 rows: steps of 1 to 6 new tokens cost about the same, the 7th adds 4 ms.
    model = StepCostModel()
    for new in (1, 2, 4, 8, 16, 32, 64):
        model.observe(one(16, new), 0.027 + 0.0004 * new + 0.004 * (new >= 7), profile=True)
    model.observe_small_steps([0.027 + 0.0004 * new + 0.004 * (new >= 7) for new in range(1, 17)])
    c = model.quiet.coefficients
    position = c.per_context + c.per_pair * 301  # what a token at position 300 adds besides
    assert model.quiet.token_seconds(300, step_tokens=2) == pytest.approx(0.0004 + position, rel=1e-6)
    assert model.quiet.token_seconds(300, step_tokens=6) == pytest.approx(0.0044 + position, rel=1e-6)
    past = model.quiet.token_seconds(300, step_tokens=16)  # past the measured steps: the fit's slope
    assert past == pytest.approx(c.per_token + c.per_token_past_first_knee + c.per_token_past_second_knee + position,
                                 rel=1e-6)


def test_a_noisy_small_step_timing_is_pooled_with_its_neighbours_so_no_token_comes_out_free_or_dear():
    model = StepCostModel()
    model.observe_small_steps([0.020, 0.023, 0.021, 0.022, 0.024])
    assert model.small_steps == pytest.approx((0.020, 0.022, 0.022, 0.022, 0.024))


def test_a_chunk_deep_in_a_prompt_costs_more_and_fits_fewer_tokens_in_the_same_seconds():
    model = StepCostModel()
    for cached, new in [(0, 1), (0, 64), (4000, 1), (4000, 64), (100, 16), (2000, 32)]:
        shape = one(cached, new)
        model.observe(shape, 0.01 + 0.001 * shape.tokens + 0.000001 * shape.pairs, profile=True)
    assert model.chunk_seconds(4000, 32) > 4 * model.chunk_seconds(0, 32)
    shallow, deep = model.tokens_within(0.1, 0), model.tokens_within(0.1, 4000)
    assert shallow > 4 * deep > 0
    for cached, fitted in [(0, shallow), (4000, deep)]:  # the most that fit: one more does not
        assert model.chunk_seconds(cached, fitted) <= 0.1 < model.chunk_seconds(cached, fitted + 1)
    assert model.tokens_within(0.0, 0) == 0


def test_recent_steps_outweigh_the_profile_when_the_machine_changes():
    model = StepCostModel()
    for tokens in (1, 16, 64):
        for context in (0, 2000):
            model.observe(one(context, tokens), 0.01 + 0.001 * tokens, profile=True)
    for _ in range(300):  # the same steps now take twice as long (say, a neighbour took a core)
        for tokens in (1, 16, 64):
            model.observe(one(1000, tokens), 2 * (0.01 + 0.001 * tokens))
    assert model.predict(one(1000, 16)) == pytest.approx(2 * 0.026, rel=0.1)


def test_draft_tokens_are_priced_by_the_profile_whatever_the_load_adds_to_the_steps():
    def quiet_seconds(shape):
        return 0.02 + 0.001 * shape.tokens + 0.000002 * shape.context

    model = StepCostModel()
    for tokens in (1, 16, 64):
        for context in (0, 2000):
            model.observe(one(context, tokens), quiet_seconds(one(context, tokens)), profile=True)
    profiled = model.quiet
    forty = StepShape.of([(500, 1)] * 40)
    for _ in range(300):  # under load other services' work for each stream slows the steps by their sequences
        for n in (1, 16, 40):
            shape = StepShape.of([(500, 1)] * n)
            model.observe(shape, quiet_seconds(shape) + 0.002 * n)
    assert model.predict(forty) == pytest.approx(quiet_seconds(forty) + 0.080, rel=0.1)  # steps take what they take
    assert model.quiet == profiled  # a draft token against a decode is priced as the target alone measured it
    assert model.quiet.predict(forty) == pytest.approx(quiet_seconds(forty), rel=0.01)


def test_costs_never_come_out_negative():
    model = StepCostModel()
    model.observe(one(0, 1), 0.02, profile=True)
    model.observe(one(0, 64), 0.01, profile=True)  # noise: more tokens measured faster
    assert min(model.coefficients) >= 0 and model.coefficients.per_token > 0


@pytest.mark.parametrize("kv_cache_tokens", [1024, 48])
def test_the_start_up_profile_measures_the_runner_and_gives_its_memory_back(tiny_model_dir, kv_cache_tokens):
    runner = ModelRunner(tiny_model_dir, kv_cache_tokens=kv_cache_tokens, block_size=4)
    model = StepCostModel()
    model.profile(runner)
    assert runner.allocator.num_free_blocks == runner.allocator.num_blocks
    assert model.predict(one(0, 64)) > model.predict(one(0, 1)) > 0
    if kv_cache_tokens > SMALL_STEP_TOKENS + 64:  # room for the short sequence's steps
        assert len(model.quiet.small_steps) == SMALL_STEP_TOKENS
        assert list(model.quiet.small_steps) == sorted(model.quiet.small_steps)


def _profiled_steps(model_dir) -> Counter:
    """(sequences, new tokens each, cached tokens each) of a profile's steps past their prompts, counted."""
    runner = ModelRunner(model_dir, kv_cache_tokens=1024, block_size=4)
    timed = Counter()
    forward = runner.forward
    runner.forward = lambda batch: timed.update([(len(batch), len(batch[0].token_ids), batch[0].start_position)]
                                                * (batch[0].start_position > 0)) or forward(batch)
    StepCostModel().profile(runner)
    return timed


def test_the_profile_times_the_steps_that_price_a_batch_1_draft_more_often_than_the_rest(tiny_model_dir):
    """Their differences are tenths of a millisecond: the fastest of a few timings of them was noise."""
    timed = _profiled_steps(tiny_model_dir)
    assert all(timed[1, new, 16] == SMALL_STEP_REPEATS for new in range(1, SMALL_STEP_TOKENS + 1))  # every count
    assert timed[8, 1, 32] == timed[8, 2, 32] == SMALL_STEP_REPEATS  # up to 16 new tokens in all
    assert timed[1, 32, 16] == timed[8, 4, 32] == PROFILE_REPEATS < SMALL_STEP_REPEATS


def test_where_steps_are_slow_the_profile_times_the_larger_ones_once(tiny_model_dir, monkeypatch):
    """So that a target whose tokens cost milliseconds each (bf16 without AVX512) starts in seconds, not minutes."""
    monkeypatch.setattr(cost_model, "REPEAT_WITHIN_SECONDS", 0.0)  # every batch shape's first round overran it
    timed = _profiled_steps(tiny_model_dir)
    assert timed[1, 1, 16] == timed[1, 16, 16] == timed[8, 2, 32] == SMALL_STEP_REPEATS
    larger = [count for (seqs, new, _), count in timed.items() if seqs * new > SMALL_STEP_TOKENS]
    assert len(larger) == 2 + 5 + 5 and set(larger) == {1}  # 32 and 64 new tokens alone; 4 to 64 in batches of 8


def test_a_term_the_data_pushes_below_zero_is_held_at_zero_and_the_others_refitted():
    model = StepCostModel()
    # Steps whose cost falls with length (noise): the best non-negative fit drops that term.
    for tokens, context, seconds in [(1, 10, 0.021), (1, 1000, 0.020), (32, 40, 0.030), (32, 1000, 0.029)]:
        model.observe(StepShape(tokens, context, pairs=0), seconds, profile=True)
    fixed, per_token, _, _, per_context, per_pair = model.coefficients
    assert per_context == 0 and per_pair == 0
    assert fixed == pytest.approx(0.0205, abs=5e-4) and per_token == pytest.approx(0.0003, rel=0.05)


def test_a_saved_profile_gives_a_target_of_the_same_key_the_same_prices_and_no_other(tmp_path):
    measured = StepCostModel()
    for tokens in (1, 2, 4, 8, 16, 32, 64):  # first tokens nearly free, then 1 ms each
        measured.observe(one(16, tokens), 0.010 + 0.0002 * min(tokens, 4) + 0.001 * max(tokens - 4, 0), profile=True)
    path = tmp_path / "profile.json"
    measured.save_profile(path, key="model cpu bfloat16 threads=2")
    same = StepCostModel()
    assert same.load_profile(path, key="model cpu bfloat16 threads=2")
    assert same.coefficients == measured.coefficients and same.knees == measured.knees
    assert same.small_steps == measured.small_steps == ()
    measured.observe_small_steps([0.010, 0.0101, 0.0125])
    measured.save_profile(path, key="model cpu bfloat16 threads=2")
    assert StepCostModel().load_profile(path, key="model cpu bfloat16 threads=2")
    again = StepCostModel()
    again.load_profile(path, key="model cpu bfloat16 threads=2")
    assert again.small_steps == measured.small_steps and again.quiet.small_steps == measured.small_steps
    assert not StepCostModel().load_profile(path, key="model cpu float32 threads=2")
    assert not StepCostModel().load_profile(tmp_path / "none.json", key="model cpu bfloat16 threads=2")
