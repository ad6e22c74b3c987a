"""The statistics every report rests on, as specifications."""
import pytest

from specd_cli.bench.records import RequestRecord
from specd_cli.bench.stats import (OVERALL, acceptance_length, acceptance_rate, greedy_matches, greedy_mismatches,
                               inter_token_latencies, percentile, prompt_length_mismatches, stream_gaps,
                               summarize_serve_run, summarize_spec, tokens_per_second, ttft_s)


def record(system="none", prompt_id="1", category="writing", temperature=0.0, tokens=(5, 6, 7), chunks=None,
           e2e_s=1.0, steps=None, drafts=0, accepted=0, error=None, prompt_tokens=10, **extra):
    return RequestRecord(system, prompt_id, category, temperature, None, 32, prompt_tokens=prompt_tokens,
                         token_ids=list(tokens), chunks=chunks or [(0.1 * (i + 1), 1) for i in range(len(tokens))],
                         e2e_s=e2e_s, verification_steps=max(len(tokens) - 1, 0) if steps is None else steps,
                         draft_tokens=drafts, accepted_draft_tokens=accepted, error=error, **extra)


def test_percentile_interpolates_linearly_between_ranks_like_numpy():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([10.0, 0.0, 5.0], 100) == 10.0
    assert percentile([3.0, 1.0, 2.0], 0) == 1.0
    assert percentile([1.0, 2.0], 95) == pytest.approx(1.95)
    assert percentile([], 50) is None


def test_ttft_is_the_first_chunk_that_carried_a_token():
    assert ttft_s(record(chunks=[(0.25, 1), (0.5, 3)], tokens=[1, 2, 3, 4])) == 0.25
    assert ttft_s(record(tokens=[], chunks=[])) is None


def test_a_chunk_of_n_tokens_gives_n_inter_token_gaps_of_a_nth_of_its_interval():
    r = record(tokens=[1, 2, 3, 4, 5], chunks=[(1.0, 1), (1.1, 1), (1.5, 3)])
    assert inter_token_latencies(r) == pytest.approx([0.1, 0.4 / 3, 0.4 / 3, 0.4 / 3])


def test_a_stream_gap_is_one_sample_per_chunk_however_many_tokens_it_carries():
    r = record(tokens=[1, 2, 3, 4, 5], chunks=[(1.0, 1), (1.1, 1), (1.5, 3)])
    assert stream_gaps(r) == pytest.approx([0.1, 0.4])


def test_tokens_per_second_weighs_requests_by_their_length():
    short, long = record(tokens=[1] * 10, e2e_s=1.0), record(tokens=[1] * 90, e2e_s=9.0)
    assert tokens_per_second([short, long]) == pytest.approx(10.0)
    assert tokens_per_second([]) is None


def test_acceptance_length_excludes_the_prefills_token():
    # 1 token from the prefill, then 9 tokens in 3 decoding steps: tau = 3, not 10 / 3.
    assert acceptance_length([record(tokens=[1] * 10, steps=3)]) == pytest.approx(3.0)
    # without speculation every decoding step yields one token
    assert acceptance_length([record(tokens=[1] * 10, steps=9)]) == pytest.approx(1.0)


def test_acceptance_length_pools_steps_and_skips_prefill_only_requests():
    rs = [record(tokens=[1] * 7, steps=2), record(tokens=[1] * 4, steps=3), record(tokens=[1], steps=0)]
    assert acceptance_length(rs) == pytest.approx((6 + 3) / (2 + 3))
    assert acceptance_length([record(tokens=[1], steps=0)]) is None


def test_acceptance_rate_is_accepted_over_drafted_and_absent_without_drafts():
    assert acceptance_rate([record(drafts=10, accepted=4), record(drafts=10, accepted=1)]) == pytest.approx(0.25)
    assert acceptance_rate([record(drafts=0)]) is None
    assert acceptance_rate([record(drafts=None, accepted=None)]) is None


def test_greedy_outputs_are_compared_token_for_token_with_none_on_the_same_prompt():
    rs = [record("none", "1", tokens=[1, 2]), record("ngram", "1", tokens=[1, 2]),
          record("none", "2", tokens=[3, 4]), record("ngram", "2", tokens=[3, 5]),
          record("ngram", "3", tokens=[9]),  # none has no output here: nothing to compare with
          record("ngram", "1", temperature=1.0, tokens=[7])]  # sampled: never compared
    assert greedy_matches(rs) == {"none": (2, 2), "ngram": (1, 2)}
    assert greedy_mismatches(rs) == [("ngram", "2")]


def test_failed_requests_are_not_compared():
    rs = [record("none", tokens=[1]), record("ngram", tokens=[], error="UNAVAILABLE: gone")]
    assert greedy_matches(rs) == {"none": (1, 1)}


def test_systems_that_saw_different_prompt_lengths_are_flagged():
    rs = [record("none", "1", prompt_tokens=10), record("hf", "1", prompt_tokens=11),
          record("none", "2", prompt_tokens=5), record("hf", "2", prompt_tokens=5)]
    assert prompt_length_mismatches(rs) == ["1"]


def test_spec_summary_has_each_category_then_overall_with_ratios_to_the_references():
    rs = [record("none", "1", "writing", tokens=[1] * 10, e2e_s=2.0),
          record("ngram", "1", "writing", tokens=[1] * 10, e2e_s=1.0, steps=3, drafts=12, accepted=6),
          record("hf", "1", "writing", tokens=[1] * 10, e2e_s=4.0),
          record("none", "2", "coding", tokens=[2] * 10, e2e_s=2.0),
          record("ngram", "2", "coding", tokens=[2] * 10, e2e_s=2.0, steps=9),
          record("hf", "2", "coding", tokens=[2] * 10, e2e_s=4.0)]
    summaries = summarize_spec(rs, systems=["none", "ngram", "hf"], references=["none", "hf"])
    assert [(s.category, s.system) for s in summaries] == [
        (c, s) for c in ("writing", "coding", OVERALL) for s in ("none", "ngram", "hf")]
    ngram_writing, ngram_overall = summaries[1], summaries[7]
    assert ngram_writing.ratios == {"none": pytest.approx(2.0), "hf": pytest.approx(4.0)}
    assert ngram_overall.tokens_per_s == pytest.approx(20 / 3)
    assert ngram_overall.ratios["none"] == pytest.approx((20 / 3) / 5)
    assert ngram_overall.acceptance_length == pytest.approx((9 + 9) / (3 + 9))
    assert ngram_overall.acceptance_rate == pytest.approx(0.5)
    assert (ngram_overall.greedy_matched, ngram_overall.greedy_compared) == (2, 2)


def test_spec_summary_keeps_temperatures_apart_and_sampled_rows_have_no_greedy_check():
    rs = [record("none", temperature=t) for t in (0.0, 1.0)] + [record("ngram", temperature=t) for t in (0.0, 1.0)]
    summaries = summarize_spec(rs, systems=["none", "ngram"], references=["none"])
    assert [(s.temperature, s.category) for s in summaries][::2] == [(0.0, "writing"), (0.0, OVERALL),
                                                                     (1.0, "writing"), (1.0, OVERALL)]
    assert all(s.greedy_compared is None for s in summaries if s.temperature == 1.0)


def test_a_failed_request_counts_as_failed_and_not_in_the_speed():
    rs = [record("none", e2e_s=1.0), record("none", prompt_id="2", tokens=[], e2e_s=50.0, error="DEADLINE_EXCEEDED")]
    (summary, _) = summarize_spec(rs, systems=["none"], references=["none"])
    assert (summary.requests, summary.failed) == (2, 1)
    assert summary.tokens_per_s == pytest.approx(3.0)


def test_serve_run_throughput_is_over_first_sent_to_last_finished():
    rs = [record(tokens=[1] * 10, e2e_s=2.0, sent_at_s=1.0), record(tokens=[1] * 30, e2e_s=3.0, sent_at_s=2.0),
          record(tokens=[], e2e_s=0.5, sent_at_s=1.5, error="UNAVAILABLE: x")]
    s = summarize_serve_run("ngram", 4, rs)
    assert (s.requests, s.failed, s.duration_s) == (3, 1, pytest.approx(4.0))
    assert s.request_throughput == pytest.approx(2 / 4.0)
    assert s.output_tokens_per_s == pytest.approx(40 / 4.0)
    assert set(s.ttft_s) == {"p50", "p95", "p99"}
    assert s.e2e_s["p50"] == pytest.approx(2.5)


def test_serve_run_throughput_over_rounds_counts_each_rounds_span_and_not_the_time_between():
    # The second round started while other methods had their turn: its times count from its own start.
    rs = [record(tokens=[1] * 10, e2e_s=2.0, sent_at_s=0.5), record(tokens=[1] * 10, e2e_s=1.0, sent_at_s=0.0,
                                                                  load_round=1)]
    s = summarize_serve_run("ngram", 4, rs)
    assert s.duration_s == pytest.approx(2.0 + 1.0)
    assert s.output_tokens_per_s == pytest.approx(20 / 3.0)
