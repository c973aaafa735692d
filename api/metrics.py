"""Prometheus metrics (every one is listed in docs/metrics.md).

Per replica (take `sum` over replicas): request latencies from a middleware, protocol
transaction latencies and errors by operation (the `observe` hook of
staleflow_db.idempotency.transactional), long-poll waiters. Under `staleflow serve --workers N`
(PROMETHEUS_MULTIPROC_DIR set) a replica is N processes: each writes these figures to its own
files in that directory and a scrape of any of them sums them all (prometheus_client's
multiprocess mode). From the database at scrape time
(the same on every replica: take `max`, not `sum`): run versions, queue depth by level,
buffer states, staleness of trained samples, instances by state, drops by reason, coordinator
cycles, lock waits. Those are cached briefly so concurrent scrapes cost one query.

Every label has few values: routes are templates, operations are method names, queue levels
are capped, reasons outside DropReason are "other"; `run` covers the newest runs only.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from staleflow_db.protocol import MetricsRows
from staleflow_db.rules import BufferCounts, buffer_state
from workers.wire.enums import DropReason

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 5, 10, 20)
BUFFER_STATES = ("waiting", "stuck", "ready", "consumed")
INSTANCE_STATES = ("active", "lapsed", "expired", "deregistered")
MAX_LEVEL = 10  # queue levels 0..min(eta + 1, MAX_LEVEL) versions behind; further back is "older"
REASONS = frozenset(r.value for r in DropReason)
PHASES = ("snapshot", "decide", "write")
COMMANDS = ("routed", "interrupted", "pulled", "migrated")
# always exported (zero when none wait): row locks (the per-run lock among them) and advisory locks (idempotency keys)
LOCK_TYPES = ("relation", "tuple", "transactionid", "advisory")
GROUP_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 60)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class Metrics:
    def __init__(self, read: Callable[[], MetricsRows], cache_seconds: float = 2.0):
        # prometheus_client chose its value store (memory or files) when it was imported: from
        # the same variable, so both agree as long as nobody changes it in a running process.
        self.multiproc_dir = os.environ.get(MULTIPROC_ENV) or None
        self.registry = CollectorRegistry()  # this process's metrics (+ the database, single-process)
        self.latency = Histogram(
            "staleflow_api_request_seconds",
            "API request latency (long-polls include their wait)",
            ("method", "route", "status"),
            registry=self.registry,
            buckets=LATENCY_BUCKETS,
        )
        self.transactions = Histogram(
            "staleflow_protocol_transaction_seconds",
            "protocol transaction latency by operation, retries after deadlocks included",
            ("operation",),
            registry=self.registry,
            buckets=LATENCY_BUCKETS[:-3],
        )
        self.transaction_cpu = Counter(
            "staleflow_protocol_transaction_cpu_seconds",
            "CPU time of the replica thread that ran each protocol transaction (its Python, SQLAlchemy and"
            " psycopg; not the database's, not the event loop's HTTP work), by operation",
            ("operation",),
            registry=self.registry,
        )
        self.errors = Counter(
            "staleflow_protocol_errors",
            "protocol transactions that raised (refusals and failures), by operation and exception class",
            ("operation", "error"),
            registry=self.registry,
        )
        self.waiters = Gauge(
            "staleflow_long_poll_waiters",
            "requests waiting in a long-poll now, by topic",
            ("topic",),
            registry=self.registry,
            multiprocess_mode="livesum",  # the processes alive now, not the ones that exited
        )
        # group commit (api/group_commit.py): calls per database transaction, callers waiting
        self.group_calls = Histogram(
            "staleflow_group_commit_transaction_calls",
            "API calls applied per group-commit database transaction (its count: the transactions)",
            registry=self.registry,
            buckets=GROUP_BUCKETS,
        )
        self.group_queued = Gauge(
            "staleflow_group_commit_queued",
            "API calls waiting for their group-commit transaction now (in flight included)",
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        database = _DatabaseCollector(read, cache_seconds)
        if self.multiproc_dir is None:
            self.registry.register(database)
            self.exposed = self.registry
        else:
            # Every process's files, summed, plus the database read once (not once per process).
            self.exposed = CollectorRegistry()
            _SettledFilesCollector(self.exposed, path=self.multiproc_dir)
            self.exposed.register(database)
            atexit.register(self.close)  # outside uvicorn (whose workers die by the re-raised SIGTERM)

    def close(self) -> None:
        """This process stops serving (lifespan shutdown): its live gauges leave the sum."""
        if self.multiproc_dir is not None:
            _remove_listed(glob.glob(os.path.join(self.multiproc_dir, f"gauge_live*_{os.getpid()}.db")))

    def exposition(self) -> bytes:
        """The Prometheus text of /metrics."""
        if self.multiproc_dir is not None:
            _forget_dead_processes(self.multiproc_dir)
        return generate_latest(self.exposed)

    @contextmanager
    def observe(self, operation: str) -> Iterator[None]:
        """Time one protocol transaction (the hook staleflow_db calls), and its thread's CPU."""
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        except Exception as exc:
            self.errors.labels(operation, type(exc).__name__).inc()
            raise
        finally:
            self.transactions.labels(operation).observe(time.perf_counter() - start)
            self.transaction_cpu.labels(operation).inc(time.thread_time() - cpu)

    def waiting(self, topic: str) -> Any:
        """Count a long-poll while it waits (`work:<instance>` counts as `work`)."""
        return self.waiters.labels(topic.split(":")[0]).track_inprogress()


class _SettledFilesCollector(multiprocess.MultiProcessCollector):
    """Every process's files less those being created this instant. prometheus_client creates a
    file empty and sizes it just after; a scrape reading it in between raised struct.error (a
    500). An empty file holds no values yet, so leaving it out loses nothing."""

    def __init__(self, registry: CollectorRegistry, path: str) -> None:
        # prometheus_client's multiprocess module is unannotated
        super().__init__(registry, path=path)  # type: ignore[no-untyped-call]

    def collect(self) -> Any:
        files = [f for f in glob.glob(os.path.join(self._path, "*.db")) if _sized(f)]
        return self.merge(files, accumulate=True)  # type: ignore[no-untyped-call]  # unannotated upstream


def _sized(path: str) -> bool:
    try:
        return os.path.getsize(path) > 0  # sized in one truncate: never a partial header
    except FileNotFoundError:
        return False  # a dead process's live gauges, removed since the glob


def _forget_dead_processes(path: str) -> None:
    """Drop the live gauges of processes that died without closing their metrics (SIGKILL, OOM,
    a hung worker uvicorn killed). The directory belongs to one `staleflow serve` (private, or
    the user's), so its pids are that server's workers."""
    files_of: dict[str, list[str]] = {}
    for f in glob.glob(os.path.join(path, "gauge_live*_*.db")):
        files_of.setdefault(f.rsplit("_", 1)[1].removesuffix(".db"), []).append(f)
    for pid, files in files_of.items():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            _remove_listed(files)
        except (ValueError, PermissionError):
            continue  # not a pid / another user's process: leave it


def _remove_listed(files: list[str]) -> None:
    """prometheus_client's mark_process_dead, less its failure when a file went between the
    listing and its removal: every worker that answers a scrape forgets the dead, so two scrapes
    at once (two Prometheus servers) both list a dead worker's files, and one removes them first."""
    for f in files:
        with contextlib.suppress(FileNotFoundError):
            os.remove(f)


def queue_level(version: int, eta: int, v_traj: int | None) -> str:
    """How many versions behind the run a queued sample's trajectory is, capped."""
    if v_traj is None:
        return "new"
    behind = max(version - v_traj, 0)
    return str(behind) if behind <= min(eta + 1, MAX_LEVEL) else "older"


class _DatabaseCollector:
    def __init__(self, read: Callable[[], MetricsRows], cache_seconds: float):
        self.read, self.cache_seconds = read, cache_seconds
        self._lock = threading.Lock()
        self._cached: tuple[float, list[Any]] = (0.0, [])

    def describe(self) -> list[Any]:
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
        return [up, *_run_families(data), *_coordinator_families(data), _lock_family(data)]


def _run_families(data: MetricsRows) -> list[Any]:
    version = GaugeMetricFamily("staleflow_run_version", "model version of the run", labels=["run"])
    eta = GaugeMetricFamily("staleflow_run_eta", "staleness bound η of the run, in versions", labels=["run"])
    queued = GaugeMetricFamily(
        "staleflow_queued_samples",
        "queued samples by level: versions their trajectory is behind the run ('new': never routed)",
        labels=["run", "level"],
    )
    states = GaugeMetricFamily("staleflow_buffers", "unconsumed buffers by state", labels=["run", "state"])
    entries = GaugeMetricFamily(
        "staleflow_buffer_samples", "samples held by unconsumed buffers, by kind", labels=["run", "kind"]
    )
    instances = GaugeMetricFamily(
        "staleflow_instances", "rollout instances by state ('lapsed': active, lease run out)", labels=["run", "state"]
    )
    dropped = CounterMetricFamily(
        "staleflow_dropped_groups", "filtered or aborted prompt groups by reason", labels=["run", "reason"]
    )
    runs = {r.id: r for r in data.runs}
    by_state: dict[int, dict[str, int]] = {r: dict.fromkeys(BUFFER_STATES, 0) for r in runs}
    held: dict[int, dict[str, int]] = {r: {"occupied": 0, "reserved": 0} for r in runs}
    levels: dict[tuple[int, str], int] = {}
    for r in data.runs:
        version.add_metric([str(r.id)], r.version)
        eta.add_metric([str(r.id)], r.eta)
    for q in data.queued:
        run = runs[q.run_id]
        key = (q.run_id, queue_level(run.version, run.eta, q.v_traj))
        levels[key] = levels.get(key, 0) + q.n
    for (run_id, level), n in levels.items():
        queued.add_metric([str(run_id), level], n)
    for b in data.buffers:
        limits = runs[b.run_id].limits
        by_state[b.run_id][buffer_state(BufferCounts(b.idx, b.occupied, b.reserved, b.consumed), limits)] += 1
        held[b.run_id]["occupied"] += b.occupied
        held[b.run_id]["reserved"] += b.reserved
    for run_id in runs:
        for state, n in by_state[run_id].items():
            states.add_metric([str(run_id), state], n)
        for kind, n in held[run_id].items():
            entries.add_metric([str(run_id), kind], n)
    counts: dict[int, dict[str, int]] = {r: dict.fromkeys(INSTANCE_STATES, 0) for r in runs}
    for i in data.instances:
        counts[i.run_id][i.state] = i.n
    for run_id, by in counts.items():
        for state, n in by.items():
            instances.add_metric([str(run_id), state], n)
    drops: dict[tuple[int, str], int] = {}
    for d in data.dropped:
        drop = (d.run_id, d.reason if d.reason in REASONS else "other")
        drops[drop] = drops.get(drop, 0) + d.n
    for (run_id, reason), n in drops.items():
        dropped.add_metric([str(run_id), reason], n)
    return [version, eta, queued, states, entries, instances, dropped, _staleness(data)]


def _staleness(data: MetricsRows) -> HistogramMetricFamily:
    staleness = HistogramMetricFamily(
        "staleflow_staleness_versions", "staleness (step - V_traj) of trained samples, in versions", labels=["run"]
    )
    per_run: dict[int, dict[int, int]] = {}
    for t in data.staleness:
        per_run.setdefault(t.run_id, {})[int(t.staleness)] = t.n
    for run, hist in per_run.items():
        buckets = [(str(le), sum(n for s, n in hist.items() if s <= le)) for le in STALENESS_BUCKETS]
        total = sum(hist.values())
        staleness.add_metric([str(run)], buckets + [("+Inf", total)], sum(s * n for s, n in hist.items()))
    return staleness


def _coordinator_families(data: MetricsRows) -> list[Any]:
    """Over the newest cycles of each run (gauges: a sum over all history would grow with the run)."""
    labels = ["run", "phase"]
    mean = GaugeMetricFamily(
        "staleflow_coordinator_cycle_seconds",
        "mean time of recent coordinator cycles by phase (snapshot read, decision, command write)",
        labels=labels,
    )
    worst = GaugeMetricFamily(
        "staleflow_coordinator_cycle_max_seconds", "longest phase time of recent coordinator cycles", labels=labels
    )
    last = GaugeMetricFamily(
        "staleflow_coordinator_last_cycle_seconds", "phase times of the newest coordinator cycle", labels=labels
    )
    interval = GaugeMetricFamily(
        "staleflow_coordinator_cycle_interval_seconds", "mean time between recent coordinator cycles", labels=["run"]
    )
    last_at = GaugeMetricFamily(
        "staleflow_coordinator_last_cycle_timestamp_seconds", "when the newest cycle was recorded", labels=["run"]
    )
    commands = GaugeMetricFamily(
        "staleflow_coordinator_cycle_commands",
        "mean decisions per recent coordinator cycle, by kind",
        labels=["run", "kind"],
    )
    for c in data.cycles:
        run = str(c.run_id)
        last_at.add_metric([run], float(c.last_at))
        if c.n > 1:
            interval.add_metric([run], float(c.span_s) / (c.n - 1))
        for phase in PHASES:
            mean.add_metric([run, phase], float(getattr(c, f"{phase}_ms")) / 1000)
            worst.add_metric([run, phase], float(getattr(c, f"max_{phase}_ms")) / 1000)
            last.add_metric([run, phase], float(getattr(c, f"last_{phase}_ms")) / 1000)
        for kind in COMMANDS:
            commands.add_metric([run, kind], float(getattr(c, kind)))
    return [mean, worst, last, interval, last_at, commands]


def _lock_family(data: MetricsRows) -> GaugeMetricFamily:
    waits = GaugeMetricFamily(
        "staleflow_database_lock_waiters",
        "lock requests waiting in this database at scrape time, by lock type (row locks: 'transactionid', 'tuple')",
        labels=["locktype"],
    )
    counts = dict.fromkeys(LOCK_TYPES, 0) | {w.locktype: w.n for w in data.lock_waits}
    for locktype, n in counts.items():
        waits.add_metric([locktype], n)
    return waits


class LatencyMiddleware:
    """Times every request by its route template (not the raw path: ids would explode labels),
    and closes the metrics when the app's lifespan ends (a uvicorn worker stopping)."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":

            async def send_lifespan(message: Message) -> None:
                if message["type"] == "lifespan.shutdown.complete":
                    self.metrics.close()
                await send(message)

            await self.app(scope, receive, send_lifespan)
            return
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
