"""docs/metrics.md lists exactly the metrics the running services export, with their types and labels."""
from __future__ import annotations

import pytest

from .conftest import METRICS_DOC, SPECD_ROLES

SUFFIX = {"counter": "_total"}  # the parser names a counter family without it


def documented() -> dict[tuple[str, str], tuple[str, set[str]]]:
    """(service, exposed name) -> (type, label names), from the reference table."""
    rows = {}
    for line in METRICS_DOC.read_text().splitlines():
        if not line.startswith("| `specd_"):
            continue
        name, kind, labels, service = (cell.strip(" `") for cell in line.split("|")[1:5])
        for role in SPECD_ROLES if service == "all" else (service,):
            rows[(role, name)] = (kind, {label.strip() for label in labels.split(",") if label.strip()})
    return rows


def test_the_reference_table_has_rows():
    assert len(documented()) > 30


@pytest.mark.e2e
def test_the_reference_table_matches_a_real_scrape_of_every_service(scrapes):
    doc = documented()
    scraped = {}
    for role, families in scrapes.items():
        for family in families:
            if family.name.startswith("specd_") and not family.name.endswith("_created"):
                labels = set().union(*(set(s.labels) for s in family.samples)) - {"le"}
                scraped[(role, family.name + SUFFIX.get(family.type, ""))] = (family.type, labels,
                                                                              bool(family.samples))
    assert set(doc) == set(scraped), {"undocumented": set(scraped) - set(doc), "not exported": set(doc) - set(scraped)}
    for key, (kind, labels, has_samples) in scraped.items():
        assert doc[key][0] == kind, key
        if has_samples:  # a family with no sample yet shows no labels
            assert doc[key][1] == labels, key
