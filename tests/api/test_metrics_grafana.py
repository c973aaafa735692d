"""/metrics against the shipped Grafana dashboard and Prometheus conventions: the real API on
a real database after some protocol activity is scraped and parsed; every metric a PromQL
expression of deploy/grafana/staleflow.json names must be exported, counters end in `_total`,
no label has many values, and docs/metrics.md lists every metric."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from api.metrics import queue_level
from staleflow_db.db import make_engine
from tests.api_helpers import ROLES, ApiServer, token, walk_lifecycle
from workers.client import NotFound

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "staleflow.json"
MAX_LABEL_VALUES = 30  # `route` is the widest: one value per route template

SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "gauge": ("",),
}
# PromQL words that are not metric names (functions are told apart by the `(` after them)
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}
KEYWORDS |= {"inf", "nan"}


def expressions(node: Any) -> Iterator[str]:
    """Every PromQL expression of the dashboard: panel targets and the templating queries."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                yield value
            elif key == "query" and isinstance(value, dict) and isinstance(value.get("query"), str):
                yield value["query"]
            else:
                yield from expressions(value)
    elif isinstance(node, list):
        for item in node:
            yield from expressions(item)


def metric_names(expr: str) -> set[str]:
    """Identifiers of `expr` that name series: not functions, keywords, label names or values."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # string literals
    expr = re.sub(r"\$\{\w+\}|\$\w+", "", expr)  # Grafana variables
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)  # label lists
    expr = re.sub(r"label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*\w+\s*\)", r"\1", expr)  # Grafana's (metric, label)
    names = set()
    for m in re.finditer(r"(?<![\w.])([a-zA-Z_:][\w:]*)(?!\w)(\s*\()?", expr):
        if m.group(2) is None and m.group(1).lower() not in KEYWORDS:
            names.add(m.group(1))
    return names


def test_metric_names_tokenizer() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (operation, le) (rate(a_seconds_bucket{run=~"$run", x="y(z)"}[$__rate_interval])))'
        " / on (run) group_left max by (run) (b_total offset 5m) > bool 0 and time() - c"
    )
    assert metric_names(expr) == {"a_seconds_bucket", "b_total", "c"}
    assert metric_names("label_values(staleflow_run_version, run)") == {"staleflow_run_version"}


def test_queue_levels_are_bounded() -> None:
    assert queue_level(5, 2, None) == "new"
    assert [queue_level(5, 2, v) for v in (5, 4, 2, 1, 0)] == ["0", "1", "3", "older", "older"]
    assert queue_level(50, 100, 0) == "older"  # a large η is capped too


@pytest.mark.slow
def test_metrics_against_dashboard_and_conventions(db_url) -> None:
    scraped = _scrape_after_activity(db_url)
    check_dashboard(scraped["families"], scraped["run"])
    check_conventions(scraped["families"])


def _scrape_after_activity(db_url: str) -> dict[str, Any]:
    """Families of /metrics after a full step, a refusal, a drop, coordinator cycles and a long-poll."""
    with ApiServer(db_url) as server:
        admin = server.client(token(db_url, "admin"))
        run = admin.create_run("metrics", batch_size=2, group_size=2, eta=1, samples_per_group=2)
        roles = {r: server.client(token(db_url, r, run.id)) for r in ROLES}
        walk_lifecycle(admin, roles, run.id)
        group = roles["trainer"].enqueue(run.id, [("dropped", [1, 2]), ("queued", [3, 4])])[0]
        assert roles["coordinator"].abort_group(run.id, group, reason="user")
        with pytest.raises(NotFound):
            admin.param_versions(10**9)  # a refusal: counted by staleflow_protocol_errors_total
        engine = make_engine(db_url)
        try:
            with engine.begin() as conn:
                conn.execute(
                    text(
                        "INSERT INTO coordinator_cycles (run_id, epoch, snapshot_ms, decide_ms, write_ms, routed,"
                        " interrupted, pulled, migrated) VALUES (:r, 1, 2.0, 3.0, 4.0, 2, 1, 0, 0)"
                    ),
                    [{"r": run.id}, {"r": run.id}],  # two cycles, so an interval is exported
                )
        finally:
            engine.dispose()
        idle = roles["rollout"].register(run.id, "idle", 1).instance_id
        poller = threading.Thread(target=roles["rollout"].poll, args=(run.id, idle), kwargs={"wait": 3})
        poller.start()
        try:
            body = _scrape_while_waiting(server.url)
        finally:
            poller.join(10)
    families = {f.name: f for f in text_string_to_metric_families(body)}
    return {"families": families, "run": str(run.id)}


def _scrape_while_waiting(url: str) -> str:
    """/metrics once the long-poll is parked (it shows in staleflow_long_poll_waiters)."""
    deadline = time.monotonic() + 3
    while True:
        body = httpx.get(url + "/metrics", timeout=10).text
        if re.search(r'staleflow_long_poll_waiters\{topic="work"\} [1-9]', body) or time.monotonic() > deadline:
            return body
        time.sleep(0.1)


def check_dashboard(families: dict[str, Any], run: str) -> None:
    exported = {f.name + s for f in families.values() for s in SUFFIXES.get(f.type, ("",))}
    exported |= {s.name for f in families.values() for s in f.samples}
    dashboard = json.loads(DASHBOARD.read_text())
    queried: dict[str, list[str]] = {}
    for expr in expressions(dashboard):
        for name in metric_names(expr):
            queried.setdefault(name, []).append(expr)
    assert len(queried) >= 15, sorted(queried)
    missing = {n: e for n, e in queried.items() if n not in exported}
    assert not missing, f"the dashboard queries metrics /metrics lacks: {missing}"

    # The activity shows up in the figures the panels plot.

    def value(name: str, **labels: str) -> float:
        found = [
            s.value
            for f in families.values()
            for s in f.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]
        assert found, f"no {name}{labels} in /metrics"
        return sum(found)

    assert value("staleflow_run_version", run=run) == 1
    assert value("staleflow_staleness_versions_count", run=run) == 4
    assert value("staleflow_queued_samples", run=run, level="new") == 2
    assert value("staleflow_instances", run=run, state="active") == 1  # the idle one
    assert value("staleflow_instances", run=run, state="deregistered") == 1  # walk_lifecycle's
    assert value("staleflow_dropped_groups_total", run=run, reason="user") == 1
    assert value("staleflow_coordinator_cycle_commands", run=run, kind="routed") == 2
    assert value("staleflow_coordinator_cycle_interval_seconds", run=run) == 0  # one transaction, one now()
    assert value("staleflow_coordinator_last_cycle_seconds", run=run, phase="decide") == pytest.approx(0.003)
    assert value("staleflow_protocol_transaction_seconds_count", operation="route") >= 1
    assert value("staleflow_protocol_transaction_cpu_seconds_total", operation="route") > 0
    assert value("staleflow_protocol_errors_total", operation="param_versions", error="NotFound") == 1
    assert value("staleflow_long_poll_waiters", topic="work") == 1
    assert value("staleflow_database_up") == 1


def check_conventions(families: dict[str, Any]) -> None:
    documented = (REPO / "docs" / "metrics.md").read_text()
    for f in families.values():
        if f.name.startswith(("python_", "process_")) or f.name.endswith("_created"):
            continue  # the client library's own series (_created: start time of a counter or histogram)
        assert f.name.startswith("staleflow_"), f.name
        assert f.documentation, f"{f.name} has no help text"
        assert f"`{f.name}{'_total' if f.type == 'counter' else ''}`" in documented, f"docs/metrics.md lacks {f.name}"
        if f.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in f.samples), f.name
        else:
            assert not f.name.endswith("_total"), f"{f.name} is a {f.type}, not a counter"
        if f.type == "histogram":
            assert f.name.endswith(("_seconds", "_versions", "_calls")), f"{f.name}: a histogram names its unit"
        values: dict[str, set[str]] = {}
        for s in f.samples:
            for k, v in s.labels.items():
                values.setdefault(k, set()).add(v)
        wide = {k: len(v) for k, v in values.items() if k != "le" and len(v) > MAX_LABEL_VALUES}
        assert not wide, f"{f.name}: labels with many values {wide}"
        assert "buffer" not in values, f"{f.name}: one series per buffer grows without bound"
