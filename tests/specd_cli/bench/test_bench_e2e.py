"""`specd bench spec` as a user runs it: its own stack, the real model, a tiny prompt set."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

# Written for this test (not Spec-Bench): the bench must take any file in that format.
QUESTIONS = [
    {"question_id": "t1", "category": "lists", "turns": ["Repeat this list twice: red, green, blue.", "Again."]},
    {"question_id": "t2", "category": "code", "turns": ["Write a Python function that adds two numbers."]},
    {"question_id": "t3", "category": "lists", "turns": ["Name three animals."]},
]


def test_bench_spec_writes_results_and_plot_and_greedy_outputs_match(tmp_path):
    prompts = tmp_path / "questions.jsonl"
    prompts.write_text("\n".join(json.dumps(q) for q in QUESTIONS))
    result = subprocess.run(
        [sys.executable, "-m", "specd_cli.main", "bench", "spec", "--prompts", str(prompts), "--limit", "1",
         "--max-tokens", "8", "--methods", "none,ngram", "--baselines", "hf", "--temperatures", "0",
         "--warmup", "1", "--threads", "2", "--step-logs", "--output-dir", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (tmp_path / "out").iterdir()
    assert (run_dir / "speedup_by_category.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((run_dir / "logs" / "step_cost_profile.json").read_text())["steps"]  # the target's, kept
    target_metrics = (run_dir / "logs" / "target.metrics.txt").read_text()  # as the run left them
    assert 'specd_verification_steps_total{method="ngram"}' in target_metrics
    steps = [json.loads(line) for line in (run_dir / "logs" / "steps.jsonl").read_text().splitlines()]
    assert any("ngram" in step["asked"] for step in steps) and sum(step["decodes"] for step in steps) > 0
    results = json.loads((run_dir / "results.json").read_text())
    assert results["settings"]["max_tokens"] == 8 and results["settings"]["methods"] == ["none", "ngram"]
    assert results["machine"]["torch_threads"] == 2 and results["git"]["commit"]
    records = results["records"]
    assert sorted((r["prompt_id"], r["system"]) for r in records) == [
        (p, s) for p in ("t1", "t2") for s in ("hf", "ngram", "none")]
    assert all(r["error"] is None and 0 < len(r["token_ids"]) <= 8 for r in records)
    outputs = {(r["prompt_id"], r["system"]): (r["prompt_tokens"], r["token_ids"]) for r in records}
    for prompt_id in ("t1", "t2"):
        assert outputs[(prompt_id, "ngram")] == outputs[(prompt_id, "none")] == outputs[(prompt_id, "hf")]
    assert "| specd ngram | 2 |" in result.stdout and "2/2 |" in result.stdout
