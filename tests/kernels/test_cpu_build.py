"""Building the CPU kernels: a build killed half way must not block the builds after it."""
import subprocess
import sys
import threading

from kernels.cpu import build_directory, build_lock

HOLD_THE_LOCK = """
import sys, time
from pathlib import Path
from kernels.cpu import build_lock
with build_lock(Path(sys.argv[1])):
    print("holding", flush=True)
    time.sleep(60)
"""


def test_a_torch_lock_left_by_a_killed_build_is_removed(tmp_path):
    (tmp_path / "lock").write_text("")  # what torch's FileBaton leaves when its build is killed
    with build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_a_build_in_progress_is_waited_for_and_its_lock_freed_when_it_dies(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_LOCK, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        (tmp_path / "lock").write_text("")  # torch's lock of the build in progress
        entered = threading.Event()

        def build():
            with build_lock(tmp_path):
                entered.set()

        waiting = threading.Thread(target=build, daemon=True)
        waiting.start()
        assert not entered.wait(0.5), "entered while another process was building"
        assert (tmp_path / "lock").exists()
        holder.kill()  # the build is killed half way: its flock goes with it, its torch lock stays
        assert entered.wait(10)
        waiting.join()
        assert not (tmp_path / "lock").exists()
    finally:
        holder.kill()
        holder.wait()


def test_the_build_directory_is_per_python_and_torch_build():
    import torch
    directory = build_directory()
    assert directory.parent.name == "specd_cpu_kernels"
    assert directory.name == f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
