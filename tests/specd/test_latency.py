"""A stream's latency, as every service computes it."""
import time

from specd.latency import TokenClock


def test_the_first_chunk_gives_the_time_to_first_token_and_later_ones_the_gap_per_token():
    clock = TokenClock(started=time.perf_counter() - 1.0)
    time_to_first_token, gap = clock.tick(1)
    assert time_to_first_token >= 1.0 and gap is None
    time.sleep(0.02)
    time_to_first_token, gap = clock.tick(4)
    assert time_to_first_token is None and 0.005 <= gap < 1.0  # ~0.02 s spread over 4 tokens


def test_a_chunk_without_tokens_is_not_a_token():
    clock = TokenClock()
    assert clock.tick(0) == (None, None)
    assert clock.tick(2)[0] is not None  # the first chunk with tokens is still the first
