"""Every PromQL expression in the Grafana dashboards and the alert rules reads only metrics (and labels)
that the running services really export."""
from __future__ import annotations

import re

import pytest

# Series Prometheus makes itself rather than scraping them.
PROMETHEUS_OWN = {"up"}
GROUPING_LABELS_PROMETHEUS_ADDS = {"job", "instance", "le"}

SELECTOR = re.compile(r"\b(specd_\w+|up)\b\s*(?:\{([^}]*)\})?")
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
GROUPING = re.compile(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)")


def selectors(expr: str) -> list[tuple[str, dict[str, tuple[str, str]]]]:
    """(metric name, {label: (operator, value)}) for each series selector in `expr`."""
    return [(name, {label: (op, value) for label, op, value in MATCHER.findall(matchers or "")})
            for name, matchers in SELECTOR.findall(expr)]


def grouping_labels(expr: str) -> set[str]:
    return {label.strip() for labels in GROUPING.findall(expr) for label in labels.split(",") if label.strip()}


def series_names(family) -> set[str]:
    """The names a family's samples carry in the exposition, whether or not it has any samples yet."""
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"]}.get(family.type, [""])
    return {family.name + suffix for suffix in suffixes} | {s.name for s in family.samples}


def exported(scrapes) -> dict[str, dict[str, set[str] | None]]:
    """role -> series name -> its label names (None: declared in the scrape but no sample yet)."""
    result = {}
    for role, families in scrapes.items():
        result[role] = {}
        for family in families:
            for name in series_names(family):
                labels = [set(s.labels) for s in family.samples if s.name == name]
                result[role][name] = set().union(*labels) if labels else None
    return result


def roles_selected(matchers: dict, roles) -> list[str]:
    """The services a selector's job matcher picks (the Prometheus job names are the service roles)."""
    if "job" not in matchers:
        return list(roles)
    op, value = matchers["job"]
    if op == "=":
        return [value] if value in roles else []
    assert op == "=~", f"job matcher {op}{value!r}"
    return [role for role in roles if re.fullmatch(value, role)]


def test_the_dashboards_cover_overview_and_speculative_decoding(panel_queries):
    text = " ".join(q.expr for q in panel_queries)
    for metric in ("specd_output_tokens_total", "specd_gateway_time_to_first_token_seconds_bucket",
                   "specd_requests_running", "specd_requests_waiting", "specd_kv_cache_blocks_used",
                   "specd_rpc_requests_total", "specd_accepted_tokens_total", "specd_draft_tokens_total",
                   "specd_verification_steps_total", "specd_accepted_tokens_per_position_total",
                   "specd_drafter_rpc_seconds_bucket", "specd_drafter_rpc_failures_total"):
        assert metric in text, metric
    assert {"histogram_quantile(0.5", "histogram_quantile(0.95", "histogram_quantile(0.99"} <= {
        m.group(0) for m in re.finditer(r"histogram_quantile\(0\.\d+", text)}


def test_every_query_selects_on_a_job_that_prometheus_scrapes(all_queries, prometheus_config):
    jobs = [job["job_name"] for job in prometheus_config["scrape_configs"]]
    for query in all_queries:
        for name, matchers in selectors(query.expr):
            assert roles_selected(matchers, jobs), (query.where, name)


@pytest.mark.e2e
def test_every_metric_a_dashboard_or_alert_reads_is_in_a_real_scrape_of_its_service(all_queries, scrapes):
    series = exported(scrapes)
    missing = []
    for query in all_queries:
        for name, matchers in selectors(query.expr):
            if name in PROMETHEUS_OWN:
                continue
            roles = [role for role in roles_selected(matchers, series) if name in series[role]]
            if not roles:
                missing.append((query.where, name))
                continue
            for role in roles:
                labels = series[role][name]
                if labels is not None:  # else no sample yet, so its labels are unknown
                    assert set(matchers) - {"job", "instance"} <= labels, (query.where, name, role)
    assert not missing, missing


@pytest.mark.e2e
def test_every_label_a_query_groups_by_is_on_a_metric_it_reads(all_queries, scrapes):
    labels_of: dict[str, set[str]] = {}
    for role_series in exported(scrapes).values():
        for name, labels in role_series.items():
            if labels is not None:
                labels_of[name] = labels_of.get(name, set()) | labels
    for query in all_queries:
        names = [name for name, _ in selectors(query.expr) if name not in PROMETHEUS_OWN]
        if not all(name in labels_of for name in names):
            continue  # a metric with no sample yet: its labels are unknown
        known = GROUPING_LABELS_PROMETHEUS_ADDS.union(*(labels_of[name] for name in names))
        assert grouping_labels(query.expr) <= known, (query.where, grouping_labels(query.expr) - known)


@pytest.mark.e2e
def test_after_a_few_requests_the_speculative_metrics_have_samples(scrapes):
    series = exported(scrapes)
    for name in ("specd_draft_tokens_total", "specd_accepted_tokens_total", "specd_verification_steps_total",
                 "specd_accepted_tokens_per_position_total", "specd_drafter_rpc_seconds_bucket",
                 "specd_time_to_first_token_seconds_bucket"):
        assert series["target"][name] and "method" in series["target"][name], name
