"""The target service as it starts: what it measures of itself and what it takes from others."""
from target_svc.server import TargetOptions, TargetService


async def test_targets_given_one_step_cost_profile_file_measure_it_once_and_price_steps_alike(tiny_model_dir, tmp_path):
    profile = tmp_path / "step_cost.json"
    options = TargetOptions(model=str(tiny_model_dir), address="127.0.0.1:0", metrics_address=None,
                            kv_cache_tokens=1024, step_cost_profile=str(profile))
    first = TargetService(options)
    assert profile.exists()
    written = profile.stat().st_mtime_ns
    second = TargetService(options)
    assert profile.stat().st_mtime_ns == written  # taken, not measured again
    assert second.cost_model.coefficients == first.cost_model.coefficients
