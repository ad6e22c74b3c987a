"""The running means the drafting decisions keep (what asks gained, how long they took)."""
from __future__ import annotations


def moved(mean: float | None, value: float, weight: float) -> float:
    """A moving mean after one more value of `weight`; the first value where there is none."""
    return value if mean is None else mean + weight * (value - mean)


def warmed(mean: float | None, value: float, count: int, weight: float) -> float:
    """The mean after its `count`-th value: plain over the first 1 / weight values, then moving, so that
    the first few values count in full instead of the very first alone."""
    return moved(mean, value, max(weight, 1 / count))
