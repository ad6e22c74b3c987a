"""The Triton kernels' tests, run by Triton's interpreter on CPU in a pytest subprocess.

Triton decides between interpreter and compiler when it is imported, and this
process imported it already (through transformers, in tests/conftest.py), so
the tests under triton_kernels/ run in a fresh process with TRITON_INTERPRET=1;
the variable never reaches this process or other test directories.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

TRITON_TESTS = Path(__file__).parent / "triton_kernels"
REPO_ROOT = Path(__file__).parents[2]


def test_triton_kernels_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("SPECD_KERNELS", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs",
                          str(TRITON_TESTS)], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " skipped" not in run.stdout, run.stdout[-2000:]
