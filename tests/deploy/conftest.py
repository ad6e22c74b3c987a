"""The deployment artefacts (compose file, Prometheus config, dashboards, alert rules) and, for the
e2e checks, one real stack that has served a few requests."""
from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from specd.client import SpecdClient, build_request
from specd.types import SamplingParams
from specd.v1 import common_pb2
from specd_cli.main import DEFAULT_ADDRESSES
from specd_cli.stack import Stack, StackPorts

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
PROMETHEUS_DIR = REPO / "docker" / "prometheus"
DASHBOARD_DIR = REPO / "docker" / "grafana" / "dashboards"
METRICS_DOC = REPO / "docs" / "metrics.md"
SPECD_ROLES = tuple(DEFAULT_ADDRESSES)  # `specd serve ROLE`; also the Prometheus job names


@dataclass(frozen=True)
class Query:
    """One PromQL expression from a dashboard panel, a dashboard variable or an alert rule."""
    where: str
    expr: str


def _panels(panels: list[dict]):
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # a collapsed row holds its panels


def dashboard_queries(path: Path) -> list[Query]:
    board = json.loads(path.read_text())
    queries = [Query(f"{path.name}: {panel['title']}", target["expr"])
               for panel in _panels(board["panels"]) for target in panel.get("targets", [])]
    for variable in board["templating"]["list"]:
        # label_values(SELECTOR, LABEL) is Grafana's; the selector in it is PromQL.
        selector = re.fullmatch(r"label_values\((.*),\s*\w+\)", variable["query"]["query"]).group(1)
        queries.append(Query(f"{path.name}: variable ${variable['name']}", selector))
    return queries


def alert_queries() -> list[Query]:
    rules = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())
    return [Query(f"alerts.yml: {rule['alert']}", rule["expr"]) for group in rules["groups"] for rule in group["rules"]]


@pytest.fixture(scope="session")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="session")
def prometheus_config() -> dict:
    return yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())


@pytest.fixture(scope="session")
def panel_queries() -> list[Query]:
    return [q for path in sorted(DASHBOARD_DIR.glob("*.json")) for q in dashboard_queries(path)]


@pytest.fixture(scope="session")
def all_queries(panel_queries) -> list[Query]:
    return panel_queries + alert_queries()


# -- a live stack -----------------------------------------------------------------

async def _send_requests(address: str) -> None:
    # A prompt whose answer copies it (the n-gram drafter gets drafts accepted), and one plain request.
    prompt = "Repeat after me three times: the quick brown fox jumps over the lazy dog."
    async with SpecdClient(address) as client:
        for method, max_tokens in (("ngram", 32), ("ngram", 12), ("none", 8)):
            request = build_request(messages=[{"role": "user", "content": prompt}],
                                    sampling=SamplingParams(max_tokens=max_tokens),
                                    speculative=common_pb2.SpeculativeConfig(method=method))
            await client.complete(request, timeout=120)


@pytest.fixture(scope="package")
def stack():
    """gateway + target + the drafters on free loopback ports, after a few requests."""
    stack = Stack(ports=StackPorts.free(), threads=2)
    try:
        stack.up()
        asyncio.run(_send_requests(stack.address("gateway")))
        yield stack
    finally:
        stack.down()


@pytest.fixture(scope="package")
def scrapes(stack) -> dict[str, list]:
    """Every service's metric families (prometheus_client Metric objects), by role."""
    def families(url):
        with urllib.request.urlopen(url, timeout=5) as response:
            return list(text_string_to_metric_families(response.read().decode()))
    return {role: families(stack.metrics_url(stack.services_of(role)[0])) for role in SPECD_ROLES}
