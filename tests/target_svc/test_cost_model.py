"""The step cost model: fitted to what steps measured, at start-up and online."""
import pytest

from target_svc.cost_model import StepCostModel, StepShape
from target_svc.engine.runner import ModelRunner


def test_it_recovers_a_linear_cost_from_measured_steps():
    model = StepCostModel()
    for tokens, context in [(1, 0), (32, 0), (1, 4000), (256, 1000), (8, 8000)]:
        model.observe(StepShape(tokens, context), 0.01 + 0.0004 * tokens + 0.000002 * context, profile=True)
    assert model.coefficients == pytest.approx((0.01, 0.0004, 0.000002), rel=1e-3)
    assert model.predict(StepShape(10, 500)) == pytest.approx(0.01 + 0.004 + 0.001, rel=1e-3)


def test_recent_steps_outweigh_the_profile_when_the_machine_changes():
    model = StepCostModel()
    for tokens in (1, 16, 64):
        for context in (0, 2000):
            model.observe(StepShape(tokens, context), 0.01 + 0.001 * tokens, profile=True)
    for _ in range(300):  # the same steps now take twice as long (say, a neighbour took a core)
        for tokens in (1, 16, 64):
            model.observe(StepShape(tokens, 1000), 2 * (0.01 + 0.001 * tokens))
    assert model.predict(StepShape(16, 1000)) == pytest.approx(2 * 0.026, rel=0.1)


def test_costs_never_come_out_negative():
    model = StepCostModel()
    model.observe(StepShape(1, 0), 0.02, profile=True)
    model.observe(StepShape(64, 0), 0.01, profile=True)  # noise: more tokens measured faster
    fixed, per_token, per_context = model.coefficients
    assert fixed >= 0 and per_token > 0 and per_context >= 0


@pytest.mark.parametrize("kv_cache_tokens", [1024, 48])
def test_the_start_up_profile_measures_the_runner_and_gives_its_memory_back(tiny_model_dir, kv_cache_tokens):
    runner = ModelRunner(tiny_model_dir, kv_cache_tokens=kv_cache_tokens, block_size=4)
    model = StepCostModel()
    model.profile(runner)
    assert runner.allocator.num_free_blocks == runner.allocator.num_blocks
    assert model.predict(StepShape(64, 0)) > model.predict(StepShape(1, 0)) > 0


def test_a_term_the_data_pushes_below_zero_is_held_at_zero_and_the_others_refitted():
    model = StepCostModel()
    # Steps whose cost falls with length (noise): the best non-negative fit drops that term.
    for tokens, context, seconds in [(1, 10, 0.021), (1, 1000, 0.020), (32, 40, 0.030), (32, 1000, 0.029)]:
        model.observe(StepShape(tokens, context), seconds, profile=True)
    fixed, per_token, per_context = model.coefficients
    assert per_context == 0
    assert fixed == pytest.approx(0.0205, abs=5e-4) and per_token == pytest.approx(0.0003, rel=0.05)
