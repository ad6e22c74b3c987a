"""A real Prometheus (Debian's package: `make prometheus`) checks the repo's config and rules, scrapes a
real stack with the repo's scrape jobs, and evaluates every dashboard and alert query."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from specd.ports import free_ports

from .conftest import PROMETHEUS_DIR

PROMETHEUS, PROMTOOL = shutil.which("prometheus"), shutil.which("promtool")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (make prometheus)")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="no promtool binary (make prometheus)")

# Grafana's variables, as a dashboard showing every method over the last minute would fill them in.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "1m", "$method": ".*"}
# Queries that read only failures: a healthy stack has none, so these may come back empty.
READS_FAILURES = re.compile(r'specd_drafter_rpc_failures_total|code\s*(!=|=~)\s*"')


@needs_promtool
@pytest.mark.parametrize("check", [["check", "config", "prometheus.yml"], ["check", "rules", "alerts.yml"]])
def test_promtool_accepts_the_scrape_config_and_alert_rules(check):
    result = subprocess.run([PROMTOOL, *check], cwd=PROMETHEUS_DIR, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


class PrometheusApi:
    def __init__(self, url: str):
        self.url = url

    def get(self, path: str, **params) -> dict:
        try:
            with urllib.request.urlopen(f"{self.url}{path}?{urllib.parse.urlencode(params)}", timeout=10) as reply:
                return json.load(reply)
        except urllib.error.HTTPError as err:  # a bad query: 400 with the error in the body
            return json.load(err)

    def query(self, expr: str) -> dict:
        return self.get("/api/v1/query", query=expr)


def _scrapes_so_far(api: PrometheusApi) -> float:
    try:
        result = api.query("min(count_over_time(up[1m]))")["data"]["result"]
    except OSError:  # not listening yet
        return 0
    return float(result[0]["value"][1]) if result else 0


@pytest.fixture(scope="module")
def prometheus(stack, prometheus_config, tmp_path_factory):
    """Prometheus with the repo's scrape jobs and rules, pointed at the local stack, scraping every second."""
    workdir = tmp_path_factory.mktemp("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(PROMETHEUS_DIR / name) for name in prometheus_config["rule_files"]],
        # The job names are the service roles; only the addresses change, from compose's to the stack's.
        "scrape_configs": [{"job_name": job["job_name"], "static_configs": [
            {"targets": [stack.metrics_url(service).removeprefix("http://").removesuffix("/metrics")
                         for service in stack.services_of(job["job_name"])]}]}
            for job in prometheus_config["scrape_configs"]],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    (port,) = free_ports(1)
    with open(workdir / "log", "w") as log:
        process = subprocess.Popen([PROMETHEUS, f"--config.file={workdir / 'prometheus.yml'}",
                                    f"--storage.tsdb.path={workdir / 'data'}",
                                    f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=log)
    api = PrometheusApi(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 30
        while _scrapes_so_far(api) < 3:  # rate() needs two samples; a third makes sure rules ran too
            assert process.poll() is None and time.monotonic() < deadline, Path(workdir / "log").read_text()
            time.sleep(0.5)
        yield api
    finally:
        process.terminate()
        process.wait(timeout=10)


def _filled_in(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


@needs_prometheus
@pytest.mark.e2e
def test_prometheus_scrapes_every_service_of_the_stack(prometheus):
    up = prometheus.query("up")["data"]["result"]
    assert {(s["metric"]["job"], s["value"][1]) for s in up} == {("gateway", "1"), ("target", "1"), ("drafter", "1")}


@needs_prometheus
@pytest.mark.e2e
def test_every_dashboard_and_alert_query_evaluates(prometheus, all_queries):
    failed = {q.where: reply.get("error") for q in all_queries
              if (reply := prometheus.query(_filled_in(q.expr)))["status"] != "success"}
    assert not failed


@needs_prometheus
@pytest.mark.e2e
def test_every_dashboard_query_returns_data_unless_it_reads_only_failures(prometheus, panel_queries):
    empty = [q.where for q in panel_queries
             if not READS_FAILURES.search(q.expr) and not prometheus.query(_filled_in(q.expr))["data"]["result"]]
    assert not empty


@needs_prometheus
@pytest.mark.e2e
def test_a_healthy_stack_fires_no_alert(prometheus):
    rules = [rule for group in prometheus.get("/api/v1/rules")["data"]["groups"] for rule in group["rules"]]
    assert rules and all(rule["health"] == "ok" for rule in rules), rules
    assert [rule["name"] for rule in rules if rule["state"] != "inactive"] == []
