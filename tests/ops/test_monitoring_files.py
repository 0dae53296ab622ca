"""The shipped alert rules (``ops/prometheus/alerts.yml``) and Grafana dashboard (``ops/grafana/rebound.json``) use
only metric names and labels a worker exposes: taken from a scrape of a runtime with every feature on."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from faust.types import TP
from prometheus_client.parser import text_string_to_metric_families

from app.views import metrics_text
from rebound.undecodable import UndecodableBatches
from tests.agents.conftest import clock, make_runtime

__all__ = ["clock", "make_runtime"]

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "ops" / "prometheus" / "alerts.yml"
ALERT_TESTS = ROOT / "ops" / "prometheus" / "alerts.test.yml"
DASHBOARD = ROOT / "ops" / "grafana" / "rebound.json"
SEVERITIES = {"critical", "warning", "info"}
SCRAPE_LABELS = {"job", "instance"}  # added by Prometheus to every scraped series
METRIC = re.compile(r"\b(rebound_[a-z0-9_]+)\b")
SELECTOR = re.compile(r"\b(rebound_[a-z0-9_]+)\s*\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
LEGEND = re.compile(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")


class StartedConsumer:
    """Just enough of a started Faust consumer for the lag gauge to have a sample."""

    def __init__(self) -> None:
        undecodable = UndecodableBatches()
        undecodable.failed("items", 0, 7, 9, "CorruptRecordException()", now=0.0, now_ms=0)
        self._thread = type("Thread", (), {"_consumer": object(), "undecodable": undecodable})()
        self._committed_offset = {TP("items", 0): 5}

    def highwater(self, tp: TP) -> int:
        return 9


@pytest.fixture
def scraped(make_runtime: Any) -> str:
    """A scrape of everything a worker can expose: a runtime with the breaker and key-ordered mode on, a consumer,
    one observation of each labelled metric and one release tick."""
    runtime = make_runtime(ordering="key", breaker_enabled=True)
    runtime.metrics.attempt("items", None, "dead", "exhausted", "ValueError")
    runtime.metrics.handler_called("items", "1s", 0.01, None)
    runtime.metrics.released("items", "1s", 12)
    runtime.metrics.release_ticked(0.0003)
    runtime.app.assignor.assigned_actives = lambda: {TP("items", 0)}
    runtime.app.consumer = StartedConsumer()
    return metrics_text(runtime)


@pytest.fixture
def exposed(scraped: str) -> dict[str, set[str]]:
    """Every sample name a worker can expose, with its label names."""
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(scraped):
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(family.type, ("",))
        for suffix in suffixes:
            names.setdefault(family.name + suffix, set())
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def alert_rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(ALERTS.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def dashboard_queries() -> Iterator[tuple[str, str, str]]:
    """(where, expression, legend) of every query in the dashboard, the template variables' included."""
    document = json.loads(DASHBOARD.read_text())
    for variable in document["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            yield f"variable {variable['name']}", query["query"], ""
    for panel in document["panels"]:
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r}", target["expr"], target.get("legendFormat", "")


def unknown_names_and_labels(expr: str, exposed: dict[str, set[str]]) -> list[str]:
    problems = [f"metric {name} is not exposed" for name in METRIC.findall(expr) if name not in exposed]
    known = set(SCRAPE_LABELS)
    for name in METRIC.findall(expr):
        known |= exposed.get(name, set())
    for name, matchers in SELECTOR.findall(expr):
        problems += [
            f"{name} has no label {label}"
            for label in MATCHER.findall(matchers)
            if label not in exposed.get(name, set()) | SCRAPE_LABELS
        ]
    for grouping in GROUPING.findall(expr):
        problems += [
            f"no metric of the expression has label {label}"
            for label in (part.strip() for part in grouping.split(","))
            if label and label not in known
        ]
    return problems


def test_the_scrape_has_every_family_the_files_rely_on(exposed: dict[str, set[str]]) -> None:
    assert exposed["rebound_attempts_total"] == {"topic", "tier", "outcome", "reason", "error_class"}
    assert exposed["rebound_release_lateness_seconds_bucket"] == {"topic", "tier", "le"}
    assert exposed["rebound_handler_duration_seconds_bucket"] == {"topic", "tier", "result", "le"}
    assert exposed["rebound_consumer_lag"] == {"topic", "partition"}
    assert exposed["rebound_undecodable_offset"] == {"topic", "partition"}
    assert exposed["rebound_undecodable_batches_total"] == {"topic", "partition"}
    assert exposed["rebound_tier_oldest_overdue_seconds"] == {"topic", "tier"}
    assert {"rebound_breaker_state", "rebound_ordering_blocked_keys"} <= set(exposed)
    assert exposed["rebound_release_tick_seconds_bucket"] == {"le"}


def test_every_alert_is_complete_and_uses_exposed_metrics(exposed: dict[str, set[str]]) -> None:
    rules = alert_rules()
    assert len(rules) >= 6
    problems: list[str] = []
    for rule in rules:
        name = rule.get("alert", "?")
        if not rule.get("for"):
            problems.append(f"{name}: no for:")
        if rule.get("labels", {}).get("severity") not in SEVERITIES:
            problems.append(f"{name}: severity label missing or not one of {sorted(SEVERITIES)}")
        if not rule.get("annotations", {}).get("summary"):
            problems.append(f"{name}: no summary annotation")
        problems += [f"{name}: {problem}" for problem in unknown_names_and_labels(rule["expr"], exposed)]
    assert not problems, problems
    expressions = " ".join(rule["expr"] for rule in rules)
    assert 'up{job="rebound"}' in expressions  # worker down
    for metric in (
        "rebound_tier_oldest_overdue_seconds",
        "rebound_attempts_total",
        "rebound_breaker_state",
        "rebound_consumer_lag",
        "rebound_undecodable_offset",
    ):
        assert metric in expressions


def test_the_dashboard_parses_and_queries_exposed_metrics(exposed: dict[str, set[str]]) -> None:
    queries = list(dashboard_queries())
    problems: list[str] = []
    for where, expr, legend in queries:
        problems += [f"{where}: {problem}" for problem in unknown_names_and_labels(expr, exposed)]
        labels = set(SCRAPE_LABELS)
        for name in METRIC.findall(expr):
            labels |= exposed.get(name, set())
        problems += [
            f"{where}: legend label {label} not in the series" for label in set(LEGEND.findall(legend)) - labels
        ]
    assert not problems, problems
    used = {name for _, expr, _ in queries for name in METRIC.findall(expr)}
    for family in (
        "rebound_tier_waiting",
        "rebound_tier_oldest_overdue_seconds",
        "rebound_attempts_total",
        "rebound_release_lateness_seconds_bucket",
        "rebound_handler_duration_seconds_bucket",
        "rebound_consumer_lag",
        "rebound_breaker_state",
    ):
        assert family in used, family
    quantiles = [expr for _, expr, _ in queries if "rebound_release_lateness_seconds_bucket" in expr]
    assert any("histogram_quantile(0.5," in expr for expr in quantiles)
    assert any("histogram_quantile(0.99," in expr for expr in quantiles)


def test_the_checker_catches_what_it_should(exposed: dict[str, set[str]]) -> None:
    assert unknown_names_and_labels('sum by (event) (rebound_events_total{event="parked"})', exposed) == [
        "metric rebound_events_total is not exposed",
        "rebound_events_total has no label event",
        "no metric of the expression has label event",
    ]
    assert unknown_names_and_labels('sum by (job, reason) (rebound_attempts_total{outcome="dead"})', exposed) == []


promtool = shutil.which("promtool")


@pytest.mark.skipif(promtool is None, reason="promtool not installed (Debian: apt-get install prometheus)")
def test_promtool_checks_the_rules_and_runs_their_unit_tests() -> None:
    assert promtool is not None
    for command in (["check", "rules", str(ALERTS)], ["test", "rules", str(ALERT_TESTS)]):
        done = subprocess.run([promtool, *command], capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(promtool is None, reason="promtool not installed (Debian: apt-get install prometheus)")
def test_promtool_lints_a_scrape(scraped: str) -> None:
    """``promtool check metrics``: the exposition parses and follows Prometheus' naming rules (units, ``_total``)."""
    assert promtool is not None
    done = subprocess.run(
        [promtool, "check", "metrics"], input=scraped, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
