"""Where a run's results go: one folder per run with results.json (machine, commit,
exact settings, summaries, every request) next to the plots and service logs."""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from dataclasses import asdict, is_dataclass
from pathlib import Path

import torch
import transformers

REPO_ROOT = Path(__file__).resolve().parents[2]


def new_run_dir(output_dir: Path, kind: str) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = output_dir / f"{kind}-{stamp}"
    run_dir.mkdir(parents=True, exist_ok=False)
    return run_dir


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(threads: int) -> dict:
    return {
        "cpu_model": cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        # Other work on the machine skews timings (torch's threads wait on each other); this says if there was any.
        "load_average_1_5_15m": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }


def _git(*args: str) -> str | None:
    try:
        result = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def git_info() -> dict:
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": _git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


def _plain(value):
    return asdict(value) if is_dataclass(value) else value


def write_json(path: Path, payload: dict) -> Path:
    # Compact: the per-request token ids would take a line each when indented.
    path.write_text(json.dumps(payload, separators=(",", ":"), default=_plain))
    return path
