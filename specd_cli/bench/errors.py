"""The one error a benchmark reports to the user instead of a traceback."""


class BenchError(Exception):
    """A benchmark cannot run as asked; the message says why and what to pass instead."""
