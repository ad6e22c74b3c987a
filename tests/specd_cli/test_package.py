"""What importing the `specd` command's package sets up before torch loads."""
import os
import subprocess
import sys


def _spin_count_seen_by(env: dict[str, str]) -> str:
    code = "import specd_cli, os; print(os.environ['GOMP_SPINCOUNT'])"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_torch_threads_spin_briefly_unless_the_environment_says_otherwise():
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    assert _spin_count_seen_by(env) == "10000"
    assert _spin_count_seen_by({**env, "GOMP_SPINCOUNT": "300000"}) == "300000"
