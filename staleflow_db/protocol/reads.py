"""Reads outside the protocol transitions: run lists, parameter versions, instance owners, the
audit views and the figures for /metrics, as named rows. Each is one short transaction."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import Connection, Row, text

from ..errors import NotFound
from ..idempotency import transactional
from .base import RUN_COLUMNS, RunRow, TxMixin, load_run


@dataclass(frozen=True)
class RunInfo:
    id: int
    name: str
    version: int
    created_at: datetime
    config: dict[str, int | bool]


@dataclass(frozen=True)
class ParamVersion:
    version: int
    size_bytes: int | None
    checksum: str | None
    location: str | None
    created_at: datetime


class InstanceOwner(NamedTuple):
    run_id: int
    token_id: int | None  # the API token that registered it (None: registered in-process)


@dataclass(frozen=True)
class MetricsRows:
    """For the newest runs: rows of (run_id, v_traj, n) queued samples, (run_id, idx,
    occupied, reserved, consumed) unconsumed buffers, (run_id, staleness, n) trained samples,
    (run_id, state, n) instances ('lapsed': active with its lease run out), (run_id, reason, n)
    dropped (filtered or aborted) groups, the newest `recent_cycles` coordinator cycles per
    run (count, time span, mean and max phase times, mean commands, the newest one's times),
    and (locktype, n) lock waits in this database now."""

    runs: list[RunRow]
    queued: Sequence[Row[Any]]
    buffers: Sequence[Row[Any]]
    staleness: Sequence[Row[Any]]
    instances: Sequence[Row[Any]] = ()
    dropped: Sequence[Row[Any]] = ()
    cycles: Sequence[Row[Any]] = ()
    lock_waits: Sequence[Row[Any]] = ()


# name of each audit view and its order (after run_id)
AUDIT_VIEWS = {
    "trained": ("trained_samples", "step, sample_id"),
    "dropped": ("dropped_samples", "sample_id"),
    "violations": ("staleness_violations", "invariant, subject"),
}


def _run_info(row: Row[Any]) -> RunInfo:
    run = RunRow.of(row._mapping)
    return RunInfo(run.id, row.name, run.version, row.created_at, run.config())


class ReadOps(TxMixin):
    @transactional
    def list_runs(
        self, run_id: int | None, limit: int, offset: int, *, conn: Connection | None = None
    ) -> list[RunInfo]:
        """Runs by id (only `run_id`, when given)."""
        where = "" if run_id is None else " WHERE id = :run"
        with self.tx(conn) as conn:
            rows = conn.execute(
                text(f"SELECT {RUN_COLUMNS}, name, created_at FROM runs{where} ORDER BY id LIMIT :n OFFSET :o"),
                {"run": run_id, "n": limit, "o": offset},
            ).all()
        return [_run_info(r) for r in rows]

    @transactional
    def get_run(self, run_id: int, *, conn: Connection | None = None) -> RunInfo:
        with self.tx(conn) as conn:
            row = conn.execute(
                text(f"SELECT {RUN_COLUMNS}, name, created_at FROM runs WHERE id = :run"), {"run": run_id}
            ).first()
        if row is None:
            raise NotFound(f"run {run_id}")
        return _run_info(row)

    @transactional
    def param_versions(self, run_id: int, limit: int, *, conn: Connection | None = None) -> list[ParamVersion]:
        """Published parameter versions, newest first."""
        with self.tx(conn) as conn:
            load_run(conn, run_id, lock=False)
            rows = conn.execute(
                text(
                    "SELECT version, size_bytes, checksum, location, created_at FROM param_versions"
                    " WHERE run_id = :run ORDER BY version DESC LIMIT :n"
                ),
                {"run": run_id, "n": limit},
            ).all()
        return [ParamVersion(**r._mapping) for r in rows]

    @transactional
    def instance_owner(self, instance_id: int, *, conn: Connection | None = None) -> InstanceOwner | None:
        """The run and registering token of an instance; None if there is no such instance."""
        with self.tx(conn) as conn:
            row = conn.execute(text("SELECT run_id, token_id FROM instances WHERE id = :i"), {"i": instance_id}).first()
        return None if row is None else InstanceOwner(row.run_id, row.token_id)

    @transactional
    def audit(
        self, view: str, run_id: int | None, limit: int, offset: int, *, conn: Connection | None = None
    ) -> list[dict[str, Any]]:
        """Rows of an audit view (`AUDIT_VIEWS`), by column name."""
        name, order = AUDIT_VIEWS[view]
        where = "" if run_id is None else " WHERE run_id = :run"
        with self.tx(conn) as conn:
            rows = conn.execute(
                text(f"SELECT * FROM {name}{where} ORDER BY run_id, {order} LIMIT :n OFFSET :o"),
                {"run": run_id, "n": limit, "o": offset},
            ).all()
        return [dict(r._mapping) for r in rows]

    def schema_revision(self) -> str | None:
        """The migration the database is at (readiness: it must be the newest one)."""
        with self.engine.connect() as c:
            return c.execute(text("SELECT version_num FROM alembic_version")).scalar()

    def metrics_rows(self, max_runs: int = 50, recent_cycles: int = 100) -> MetricsRows:
        """Figures for /metrics, for the newest runs; one read-only transaction."""
        with self.engine.connect() as c, c.begin():
            c.execute(text("SET TRANSACTION READ ONLY"))
            runs = [
                RunRow(**r._mapping)
                for r in c.execute(
                    text(f"SELECT {RUN_COLUMNS} FROM runs ORDER BY id DESC LIMIT :n"), {"n": max_runs}
                ).all()
            ]
            ids = [r.id for r in runs]
            queued = c.execute(
                text(
                    "SELECT run_id, v_traj, count(*) AS n FROM samples WHERE state = 'queued'"
                    " AND run_id = ANY(CAST(:ids AS bigint[])) GROUP BY 1, 2"
                ),
                {"ids": ids},
            ).all()
            buffers = c.execute(
                text(
                    "SELECT b.run_id, b.idx, b.occupied, b.reserved, b.consumed_at IS NOT NULL AS consumed FROM buffers b"
                    " JOIN runs r ON r.id = b.run_id WHERE b.run_id = ANY(CAST(:ids AS bigint[])) AND b.idx >= r.version"
                ),
                {"ids": ids},
            ).all()
            staleness = c.execute(
                text(
                    "SELECT s.run_id, g.buffer - s.v_traj AS staleness, count(*) AS n"
                    " FROM samples s JOIN prompt_groups g ON g.id = s.group_id"
                    " WHERE g.state = 'consumed' AND s.state = 'rewarded' AND s.run_id = ANY(CAST(:ids AS bigint[]))"
                    " GROUP BY 1, 2"
                ),
                {"ids": ids},
            ).all()
            by_run = {"ids": ids}
            instances = c.execute(
                text(
                    "SELECT run_id, CASE WHEN state = 'active' AND lease_expires_at < now() THEN 'lapsed'"
                    " ELSE state::text END AS state, count(*) AS n FROM instances"
                    " WHERE run_id = ANY(CAST(:ids AS bigint[])) GROUP BY 1, 2"
                ),
                by_run,
            ).all()
            # Groups only: aborted samples have no index, and counting them scanned all samples
            # (a tenfold slower scrape on a backlog); the audit has them one by one.
            dropped = c.execute(
                text(
                    "SELECT run_id, reason, count(*) AS n FROM prompt_groups WHERE state IN ('filtered', 'aborted')"
                    " AND run_id = ANY(CAST(:ids AS bigint[])) GROUP BY 1, 2"
                ),
                by_run,
            ).all()
            # The newest cycles only (an index range per run): sums over the whole history
            # would grow with the run, about a million rows a day at 10 cycles/s.
            cycles = c.execute(
                text(
                    "SELECT r.id AS run_id, w.* FROM unnest(CAST(:ids AS bigint[])) AS r(id) CROSS JOIN LATERAL"
                    " (SELECT count(*) AS n, extract(epoch FROM max(at)) AS last_at,"
                    " extract(epoch FROM max(at) - min(at)) AS span_s,"
                    " avg(snapshot_ms) AS snapshot_ms, avg(decide_ms) AS decide_ms, avg(write_ms) AS write_ms,"
                    " max(snapshot_ms) AS max_snapshot_ms, max(decide_ms) AS max_decide_ms,"
                    " max(write_ms) AS max_write_ms, (array_agg(snapshot_ms ORDER BY id DESC))[1] AS last_snapshot_ms,"
                    " (array_agg(decide_ms ORDER BY id DESC))[1] AS last_decide_ms,"
                    " (array_agg(write_ms ORDER BY id DESC))[1] AS last_write_ms,"
                    " avg(routed) AS routed, avg(interrupted) AS interrupted, avg(pulled) AS pulled,"
                    " avg(migrated) AS migrated FROM (SELECT * FROM coordinator_cycles c WHERE c.run_id = r.id"
                    " ORDER BY c.id DESC LIMIT :recent) x) w WHERE w.n > 0"
                ),
                by_run | {"recent": recent_cycles},
            ).all()
            lock_waits = c.execute(
                text(
                    "SELECT locktype, count(*) AS n FROM pg_locks WHERE NOT granted"
                    " AND (database IS NULL OR database = (SELECT oid FROM pg_database"
                    " WHERE datname = current_database())) GROUP BY 1"
                )
            ).all()
        return MetricsRows(runs, queued, buffers, staleness, instances, dropped, cycles, lock_waits)


# ---- the dashboard (api/routers/ui.py): one panel per read, each a read-only transaction ------

DASHBOARD_PANELS = ("steps", "staleness", "instances", "queue", "coordinator", "drops")

# A panel is named queries, bound to :run and :n (the steps asked for); it returns their rows
# by those names, reshaped where `_PANEL_SHAPES` says.
_PANEL_QUERIES: dict[str, dict[str, str]] = {
    "steps": {
        # A step is a consumed buffer: its trained samples' rewards and response tokens, and the
        # time since the step before (the first step counts from the run's creation).
        "steps": "WITH t AS (SELECT g.buffer AS step, avg(s.reward) AS reward_mean,"
        " coalesce(stddev_pop(s.reward), 0) AS reward_std, min(s.reward) AS reward_min,"
        " max(s.reward) AS reward_max, sum(s.n_tokens) AS tokens, count(*) AS samples"
        " FROM samples s JOIN prompt_groups g ON g.id = s.group_id"
        " WHERE s.run_id = :run AND g.state = 'consumed' AND s.state = 'rewarded' GROUP BY 1),"
        " b AS (SELECT b.idx AS step, b.consumed_at, CAST(extract(epoch FROM b.consumed_at - coalesce("
        "  lag(b.consumed_at) OVER (ORDER BY b.idx), r.created_at)) AS float8) AS step_s"
        "  FROM buffers b JOIN runs r ON r.id = b.run_id WHERE b.run_id = :run AND b.consumed_at IS NOT NULL)"
        " SELECT b.step, b.consumed_at, b.step_s, t.reward_mean, t.reward_std, t.reward_min, t.reward_max,"
        " t.tokens, t.samples, t.tokens / nullif(b.step_s, 0) AS tokens_per_s"
        " FROM b LEFT JOIN t USING (step) ORDER BY b.step DESC LIMIT :n",
        # Which version each instance was on: its registration and the pulls it was told to do.
        "instance_versions": "SELECT instance_id, at,"
        " CAST(coalesce(data->>'version', data->>'target') AS integer) AS version"
        " FROM events WHERE run_id = :run AND kind IN ('instance_registered', 'pull') ORDER BY id",
    },
    "staleness": {
        "histogram": "SELECT g.buffer AS step, g.buffer - s.v_traj AS staleness, count(*) AS n"
        " FROM samples s JOIN prompt_groups g ON g.id = s.group_id"
        " WHERE s.run_id = :run AND g.state = 'consumed' AND s.state = 'rewarded'"
        " AND g.buffer > (SELECT version FROM runs WHERE id = :run) - 1 - :n GROUP BY 1, 2 ORDER BY 1, 2",
        "buffers": "SELECT b.idx, b.batch_size, b.capacity, b.occupied, b.reserved"
        " FROM buffers b JOIN runs r ON r.id = b.run_id"
        " WHERE b.run_id = :run AND b.consumed_at IS NULL ORDER BY b.idx",
    },
    "instances": {
        "instances": "SELECT i.id, i.name, i.version, i.snapshot,"
        " CAST(extract(epoch FROM now() - coalesce(i.snapshot_at, i.created_at)) AS float8) AS heartbeat_age_s,"
        " CAST(extract(epoch FROM i.lease_expires_at - now()) AS float8) AS lease_left_s,"
        " (SELECT count(*) FROM samples s WHERE s.instance_id = i.id AND s.state = 'running') AS routed"
        " FROM instances i WHERE i.run_id = :run AND i.state = 'active' ORDER BY i.id",
    },
    "queue": {
        # The level of a queued sample is its V_traj (None: fresh, not generated yet).
        "levels": "SELECT v_traj AS level, count(*) AS n FROM samples WHERE run_id = :run AND state = 'queued'"
        " GROUP BY 1 ORDER BY 1 NULLS FIRST",
        "samples": "SELECT state::text AS state, count(*) AS n FROM samples WHERE run_id = :run GROUP BY 1",
    },
    "coordinator": {
        "cycles": "SELECT id, epoch, at, snapshot_ms, decide_ms, write_ms, routed, interrupted, pulled, migrated"
        " FROM coordinator_cycles WHERE run_id = :run ORDER BY id DESC LIMIT :n",
        "commands": "SELECT id, instance_id, kind::text AS kind, sample_id, target_version, state::text AS state,"
        " created_at FROM commands WHERE run_id = :run ORDER BY id DESC LIMIT 20",
    },
    "drops": {
        "reasons": "SELECT reason, count(*) AS n FROM samples WHERE run_id = :run AND state = 'aborted'"
        " GROUP BY 1 ORDER BY 2 DESC",
    },
    "audit": {
        "violations": "SELECT invariant, subject, detail FROM staleness_violations WHERE run_id = :run"
        " ORDER BY invariant, subject LIMIT 50",
    },
}
_PanelRows = dict[str, list[dict[str, Any]]]
_PANEL_SHAPES: dict[str, Callable[[_PanelRows], dict[str, Any]]] = {
    "steps": lambda rows: rows | {"steps": rows["steps"][::-1]},  # queried newest first, for LIMIT
    "queue": lambda rows: rows | {"samples": {r["state"]: r["n"] for r in rows["samples"]}},
    "coordinator": lambda rows: rows | {"cycles": rows["cycles"][::-1]},
    "audit": lambda rows: rows | {"ok": not rows["violations"]},
}


def _rows(conn: Connection, sql: str, **params: Any) -> list[dict[str, Any]]:
    return [dict(r._mapping) for r in conn.execute(text(sql), params).all()]


class DashboardReads(TxMixin):
    def dashboard(self, run_id: int, panels: Sequence[str] = DASHBOARD_PANELS, steps: int = 200) -> dict[str, Any]:
        """The run and the named panels (`DASHBOARD_PANELS`, plus "audit": the complete audit,
        which scans every segment, so callers ask for it sparingly); one snapshot of the run."""
        with self.engine.connect() as c, c.begin():
            c.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY"))
            run = load_run(c, run_id, lock=False)
            row = c.execute(text("SELECT name, created_at FROM runs WHERE id = :run"), {"run": run_id}).one()
            out: dict[str, Any] = {
                "run": {"id": run.id, "name": row.name, "created_at": row.created_at, "version": run.version}
                | run.config()
            }
            for panel in panels:
                if panel not in _PANEL_QUERIES:
                    raise ValueError(f"no dashboard panel {panel!r}")
                rows = {name: _rows(c, sql, run=run_id, n=steps) for name, sql in _PANEL_QUERIES[panel].items()}
                shape = _PANEL_SHAPES.get(panel)
                out[panel] = shape(rows) if shape else rows
        return out
