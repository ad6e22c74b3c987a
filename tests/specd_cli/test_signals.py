"""SIGTERM stops `specd bench` and `specd bench soak` the way Ctrl-C does."""
import signal
import subprocess
import sys


def test_after_sigterm_a_command_unwinds_so_the_stacks_it_started_are_stopped(tmp_path):
    """The stacks are stopped in the command's `finally`, which Python's default SIGTERM never reaches."""
    marker = tmp_path / "stopped"
    script = (
        "import asyncio\n"
        "from specd_cli.signals import interrupt_on_sigterm\n"
        "async def command():\n"
        "    try:\n"
        "        print('running', flush=True)\n"
        "        await asyncio.sleep(60)\n"
        "    finally:\n"
        f"        open({str(marker)!r}, 'w').write('stopped')\n"
        "interrupt_on_sigterm()\n"
        "asyncio.run(command())\n")
    command = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert command.stdout.readline() == "running\n"
    command.send_signal(signal.SIGTERM)
    assert command.wait(timeout=30) != 0
    assert marker.read_text() == "stopped"
