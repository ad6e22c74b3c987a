import pytest

from gateway.stop_strings import StopStringMatcher


def feed_all(matcher, deltas):
    return [matcher.feed(delta) for delta in deltas]


def test_without_stop_strings_text_passes_through_unheld():
    matcher = StopStringMatcher([])
    assert feed_all(matcher, ["Hello", " world"]) == ["Hello", " world"]
    assert matcher.finish() == ""
    assert not matcher.matched


def test_text_is_cut_before_a_stop_string_inside_one_delta():
    matcher = StopStringMatcher(["END"])
    assert matcher.feed("Hello END world") == "Hello "
    assert matcher.matched


def test_a_stop_string_spanning_three_deltas_is_matched():
    matcher = StopStringMatcher(["<stop>"])
    assert feed_all(matcher, ["Hello <s", "to", "p> more"]) == ["Hello ", "", ""]
    assert matcher.matched


def test_only_a_tail_that_could_begin_a_stop_string_is_held_back():
    matcher = StopStringMatcher(["END"])
    assert matcher.feed("abcE") == "abc"
    assert matcher.feed("x") == "Ex"
    assert not matcher.matched


def test_the_longest_tail_that_could_begin_a_stop_string_is_held():
    matcher = StopStringMatcher(["abab"])
    assert matcher.feed("xaba") == "x"  # both "aba" and "a" could begin "abab"
    assert matcher.feed("c") == "abac"


def test_the_earliest_starting_stop_string_wins_whatever_their_order():
    matcher = StopStringMatcher(["cd", "bcd"])
    assert matcher.feed("abcde") == "a"
    assert matcher.matched


def test_a_later_starting_shorter_match_waits_for_an_earlier_longer_one_to_complete():
    matcher = StopStringMatcher(["hello world", "lo"])
    assert matcher.feed("say hello w") == "say "
    assert not matcher.matched  # "lo" is there, but "hello world" starts earlier and may still follow
    assert matcher.feed("orld") == ""
    assert matcher.matched


def test_a_later_starting_shorter_match_stands_when_the_longer_one_fails():
    matcher = StopStringMatcher(["hello world", "lo"])
    assert matcher.feed("say hello w") == "say "
    assert matcher.feed("ide") == "hel"
    assert matcher.matched


def test_finish_flushes_everything_held_when_nothing_matched():
    matcher = StopStringMatcher(["END"])
    assert matcher.feed("the E") == "the "
    assert matcher.finish() == "E"
    assert not matcher.matched


def test_finish_settles_a_match_still_waiting_on_a_longer_candidate():
    matcher = StopStringMatcher(["hello world", "lo"])
    assert matcher.feed("hello") == ""
    assert matcher.finish() == "hel"
    assert matcher.matched


def test_empty_stop_strings_are_refused():
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])
