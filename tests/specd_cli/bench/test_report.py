from specd_cli.bench.beside_best import BesideBest
from specd_cli.bench.report import fmt, header_line, label, markdown_table, ms, serve_report, spec_report
from specd_cli.bench.stats import OVERALL, ServeSummary, SpecSummary


def summary(system, category=OVERALL, temperature=0.0, **kw):
    values = dict(requests=2, failed=0, completion_tokens=64, tokens_per_s=20.0, acceptance_length=1.5,
                  acceptance_rate=0.25, ttft_p50_s=0.3, ttft_p95_s=0.4, itl_p50_s=0.05, itl_p95_s=0.08,
                  ratios={"none": 1.25, "hf": None}, greedy_matched=2, greedy_compared=2)
    values.update(kw)
    return SpecSummary(system, category, temperature, **values)


def test_markdown_table_has_a_header_a_rule_and_one_line_per_row():
    assert markdown_table(["a", "b"], [["1", "2"]]).splitlines() == ["| a | b |", "| --- | --- |", "| 1 | 2 |"]


def test_missing_values_show_as_a_dash():
    assert (fmt(None), ms(None), fmt(1.234, 2, "×"), ms(0.0456)) == ("—", "—", "1.23×", "46")


def test_specd_methods_are_labelled_as_specd_and_baselines_as_they_are():
    assert (label("ngram"), label("hf-lookup")) == ("specd ngram", "hf-lookup")


def test_spec_report_has_an_overall_and_a_by_category_table_per_temperature():
    rows = [summary("ngram", "writing"), summary("ngram"), summary("ngram", "writing", 1.0, greedy_compared=None),
            summary("ngram", temperature=1.0, greedy_compared=None)]
    text = spec_report(rows, ["none", "hf"], "HEADER")
    lines = text.splitlines()
    assert lines[0] == "HEADER"
    assert "**Overall, greedy**" in lines and "**By category, sampled, temperature 1**" in lines
    overall_row = next(line for line in lines if line.startswith("| specd ngram"))
    assert overall_row == "| specd ngram | 2 | 20.0 | 1.25× | — | 1.50 | 0.25 | 300 | 50 | 80 | 2/2 |"
    assert "| writing | specd ngram |" in text and "| overall |" not in text
    assert "prefill excluded" in text


def test_spec_report_shows_auto_beside_the_fastest_single_method_overall_first_under_its_temperature():
    beside = [BesideBest("writing", 0.0, "suffix", 0.966, (0.881, 1.039)),
              BesideBest(OVERALL, 0.0, "fused", 1.018, (1.004, 1.032))]
    lines = spec_report([summary("auto"), summary("auto", temperature=1.0)], ["none"], "H", beside).splitlines()
    table = lines.index("**`auto` beside the fastest single method, greedy**")
    assert lines[table + 4:table + 6] == ["| overall | specd fused | 1.018× | 1.004-1.032 |",
                                          "| writing | specd suffix | 0.966× | 0.881-1.039 |"]
    assert "**`auto` beside the fastest single method, sampled, temperature 1**" not in lines
    assert any("each resample picking its own fastest method" in line for line in lines)
    assert not any("fastest single" in line for line in spec_report([summary("auto")], ["none"], "H").splitlines())


def test_failed_requests_show_next_to_the_request_count():
    text = spec_report([summary("none", failed=1)], ["none"], "H")
    assert "| specd none | 2 (1 failed) |" in text


def test_serve_report_has_one_row_per_system_and_concurrency():
    pct = {"p50": 0.1, "p95": 0.2, "p99": 0.3}
    rows = [ServeSummary("ngram", c, 8, 0, 10.0, 0.8, 25.0, pct, pct, pct, pct) for c in (1, 4)]
    lines = serve_report(rows, "H").splitlines()
    assert lines[4] == ("| specd ngram | 1 | 8 | 0 | 0.80 | 25.0 | 100 | 200 | 300 | 100 | 200 | 300 | 100 | 300 "
                        "| 0.10 |")
    assert lines[5].startswith("| specd ngram | 4 |")


def test_header_line_names_date_machine_threads_commit_and_settings():
    machine = {"cpu_model": "Some CPU", "usable_cores": 2, "torch": "2.13.0", "torch_threads": 2,
               "load_average_1_5_15m": [0.5, 0.25, 0.1]}
    line = header_line("spec", "2026-01-02T03:04:05", machine, {"commit": "0123456789abcdef", "dirty": True},
                       {"max_tokens": 256})
    assert line == ("`specd bench spec`, 2026-01-02, Some CPU (2 cores, load average 0.25 at the end), "
                    "torch 2.13.0, 2 threads, commit 0123456789 (dirty); max_tokens 256.")
