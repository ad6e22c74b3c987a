"""The `specd` command as a whole: every command but `specd bench` runs without the optional `bench` extra."""
from __future__ import annotations

import subprocess
import sys


def _specd_without_the_bench_extra(*argv: str) -> subprocess.CompletedProcess:
    """`specd ARGV` in a fresh interpreter in which matplotlib and tqdm cannot be imported."""
    code = ("import sys; sys.modules.update(matplotlib=None, tqdm=None)\n"
            f"from specd_cli.main import main; sys.exit(main({list(argv)!r}))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_cli_starts_without_the_bench_extra():
    result = _specd_without_the_bench_extra("serve", "drafter", "--help")
    assert result.returncode == 0, result.stderr
    assert "--listen" in result.stdout


def test_bench_without_the_extra_says_in_one_line_how_to_install_it():
    result = _specd_without_the_bench_extra("bench", "spec")
    assert result.returncode == 2
    assert result.stderr == "specd bench: needs matplotlib and tqdm: pip install 'specd[bench]'\n"
