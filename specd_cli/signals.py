"""SIGTERM as Ctrl-C, for the commands that start services of their own (`specd bench`, `specd bench soak`)."""
import signal


def interrupt_on_sigterm() -> None:
    """From now on SIGTERM raises KeyboardInterrupt, as Ctrl-C does: the command unwinds, and the stacks it
    started are stopped on the way out. (Python's default for SIGTERM ends the process on the spot, leaving
    every service of them running.)"""
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt
