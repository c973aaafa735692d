"""Prometheus metrics: request latencies from a middleware, and protocol figures (queue depth by
version, buffer states, staleness of trained samples) read from the database at scrape time.

Database figures are the same on every replica (they come from the shared database); take
`max` over replicas, not `sum`. They are cached briefly so concurrent scrapes cost one query.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from staleflow_db.protocol import MetricsRows
from staleflow_db.rules import BufferCounts, buffer_state

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 5, 10, 20)
BUFFER_STATES = ("waiting", "stuck", "ready", "consumed")


class Metrics:
    def __init__(self, read: Callable[[], MetricsRows], cache_seconds: float = 2.0):
        self.registry = CollectorRegistry()
        self.latency = Histogram(
            "staleflow_api_request_seconds",
            "API request latency (long-polls include their wait)",
            ("method", "route", "status"),
            registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.registry.register(_DatabaseCollector(read, cache_seconds))


class _DatabaseCollector:
    def __init__(self, read: Callable[[], MetricsRows], cache_seconds: float):
        self.read, self.cache_seconds = read, cache_seconds
        self._lock = threading.Lock()
        self._cached: tuple[float, list[Any]] = (0.0, [])

    def describe(self) -> list:
        return []  # no collection at registration time (the database may be down)

    def collect(self) -> Iterator[Any]:
        with self._lock:
            at, families = self._cached
            if time.monotonic() - at > self.cache_seconds:
                families = self._read()
                self._cached = (time.monotonic(), families)
        yield from families

    def _read(self) -> list[Any]:
        up = GaugeMetricFamily("staleflow_database_up", "1 if the database answered the last scrape")
        try:
            data = self.read()
        except Exception:
            up.add_metric([], 0)
            return [up]
        up.add_metric([], 1)
        version = GaugeMetricFamily("staleflow_run_version", "model version of the run", labels=["run"])
        queued = GaugeMetricFamily(
            "staleflow_queue_depth",
            "queued samples by trajectory version ('new': never routed)",
            labels=["run", "v_traj"],
        )
        states = GaugeMetricFamily("staleflow_buffers", "unconsumed buffers by state", labels=["run", "state"])
        entries = GaugeMetricFamily(
            "staleflow_buffer_entries", "entries of unconsumed buffers", labels=["run", "buffer", "kind"]
        )
        runs = {r.id: r for r in data.runs}
        counts: dict[int, dict[str, int]] = {r: dict.fromkeys(BUFFER_STATES, 0) for r in runs}
        for r in data.runs:
            version.add_metric([str(r.id)], r.version)
        for q in data.queued:
            queued.add_metric([str(q.run_id), "new" if q.v_traj is None else str(q.v_traj)], q.n)
        for b in data.buffers:
            counts[b.run_id][
                buffer_state(BufferCounts(b.idx, b.occupied, b.reserved, b.consumed), runs[b.run_id].limits)
            ] += 1
            entries.add_metric([str(b.run_id), str(b.idx), "occupied"], b.occupied)
            entries.add_metric([str(b.run_id), str(b.idx), "reserved"], b.reserved)
        for run, by_state in counts.items():
            for state, n in by_state.items():
                states.add_metric([str(run), state], n)
        staleness = HistogramMetricFamily(
            "staleflow_staleness", "staleness (step - V_traj) of trained samples", labels=["run"]
        )
        per_run: dict[int, dict[int, int]] = {}
        for t in data.staleness:
            per_run.setdefault(t.run_id, {})[int(t.staleness)] = t.n
        for run, hist in per_run.items():
            buckets = [(str(le), sum(n for s, n in hist.items() if s <= le)) for le in STALENESS_BUCKETS]
            total = sum(hist.values())
            staleness.add_metric([str(run)], buckets + [("+Inf", total)], sum(s * n for s, n in hist.items()))
        return [up, version, queued, states, entries, staleness]


class LatencyMiddleware:
    """Times every request by its route template (not the raw path: ids would explode labels)."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.metrics.latency.labels(scope["method"], route, str(status[0])).observe(time.perf_counter() - start)
