"""The read side: run lists and status, parameter versions, instance owners, the audit views,
the figures for /metrics and the dashboard's panels, as named rows. `ProtocolReads` never
writes: each method is one short transaction (or runs in the caller's) of SELECTs only, and
tests/db/test_protocol_reads.py runs every one on a read-only session."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import Connection, Row

from workers.wire.types import is_run_id

from .. import payloads, queries
from ..errors import NotFound
from ..idempotency import transactional
from ..rules import buffer_state
from .core import RunRow, TxMixin, load_run, read_buffers


@dataclass(frozen=True)
class RunInfo:
    id: int
    name: str
    version: int
    created_at: datetime
    config: dict[str, int | bool | float]
    state: str  # active, paused or cancelled (workers.wire.enums.RunState)
    state_reason: str | None  # why it was paused or cancelled


@dataclass(frozen=True)
class ParamVersion:
    version: int
    size_bytes: int | None
    checksum: str | None
    location: str | None
    created_at: datetime
    train_metrics: dict[str, float] | None  # what the trainer reported of the step (loss ...)


class InstanceOwner(NamedTuple):
    run_id: int
    token_id: int | None  # the API token that registered it (None: registered in-process)


@dataclass(frozen=True)
class MetricsRows:
    """For the newest runs: rows of (run_id, v_traj, n) queued samples, (run_id, idx,
    occupied, reserved, consumed) unconsumed buffers, (run_id, staleness, n) trained samples,
    (run_id, state, n) instances ('lapsed': active with its instance lease run out), (run_id, reason, n)
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


# the named query of each audit view (reads.sql): `audit_<view>`, `audit_<view>_of_run`
AUDIT_VIEWS = ("trained", "dropped", "violations")


def _run_info(row: Row[Any]) -> RunInfo:
    run = RunRow.of(row._mapping)
    return RunInfo(run.id, row.name, run.version, row.created_at, run.as_dict(), run.state, row.state_reason)


# ---- the dashboard (api/routers/ui.py): one panel per read, each a read-only transaction ------

DASHBOARD_PANELS = ("steps", "staleness", "instances", "queue", "coordinator", "drops")

# A panel is named queries (`panel_<panel>_<rows>` in reads.sql), bound to :run and :n (the
# steps asked for); it returns their rows by those names, reshaped where `_PANEL_SHAPES` says.
_PANEL_QUERIES: dict[str, tuple[str, ...]] = {
    "steps": ("steps", "instance_versions", "reward_metrics"),
    "staleness": ("histogram", "buffers"),
    "instances": ("instances",),
    "queue": ("levels", "samples"),
    "coordinator": ("cycles", "commands"),
    "drops": ("reasons",),
    "audit": ("violations",),
}
_PanelRows = dict[str, list[dict[str, Any]]]
_PANEL_SHAPES: dict[str, Callable[[_PanelRows], dict[str, Any]]] = {
    "steps": lambda rows: rows | {"steps": rows["steps"][::-1]},  # queried newest first, for LIMIT
    "queue": lambda rows: rows | {"samples": {r["state"]: r["n"] for r in rows["samples"]}},
    "coordinator": lambda rows: rows | {"cycles": rows["cycles"][::-1]},
    "audit": lambda rows: rows | {"ok": not rows["violations"]},
}


def _rows(conn: Connection, name: str, **params: Any) -> list[dict[str, Any]]:
    return [dict(r._mapping) for r in conn.execute(queries.text(name), params).all()]


def _export_row(row: dict[str, Any]) -> dict[str, Any]:
    """An `export_samples` row with its segments' packed payloads as per-token lists."""
    lengths, packed_tokens, packed_logprobs = row["seg_lengths"], row.pop("seg_tokens"), row.pop("seg_logprobs")
    for k in ("seg_urls", "seg_sizes", "seg_sums", "seg_offsets"):
        del row[k]
    per_token = {
        "response_tokens": payloads.unpack_tokens(b"".join(packed_tokens)),
        "logprobs": payloads.unpack_logprobs(b"".join(packed_logprobs)),
        "loss_mask": payloads.per_token(lengths, [int(g) for g in row.pop("seg_generated")]),
        "token_versions": payloads.per_token(lengths, row["seg_versions"]),
    }
    out: dict[str, Any] = {}
    for k, v in row.items():  # the per-token lists before the segments', as ExportRow has them
        if k == "seg_lengths":
            out.update(per_token)
        out[k] = v
    return out


class ProtocolReads(TxMixin):
    @transactional
    def list_runs(
        self, run_id: int | None, limit: int, offset: int, *, conn: Connection | None = None
    ) -> list[RunInfo]:
        """Runs by id (only `run_id`, when given)."""
        with self.tx(conn) as conn:
            rows = conn.execute(queries.text("list_runs"), {"run": run_id, "n": limit, "o": offset}).all()
        return [_run_info(r) for r in rows]

    @transactional
    def run_id(self, ref: int | str, *, conn: Connection | None = None) -> int:
        """The id of the run `ref` names: an int or a string of digits is an id, any other
        string a name (names are never all digits). NotFound if there is no such run."""
        if isinstance(ref, int) or is_run_id(ref):
            return int(ref)
        with self.tx(conn) as conn:
            found = conn.execute(queries.text("run_by_name"), {"name": ref}).scalar()
        if found is None:
            raise NotFound(f"run {ref!r}")
        return int(found)

    @transactional
    def get_run(self, run_id: int, *, conn: Connection | None = None) -> RunInfo:
        with self.tx(conn) as conn:
            row = conn.execute(queries.text("get_run"), {"run": run_id}).first()
        if row is None:
            raise NotFound(f"run {run_id}")
        return _run_info(row)

    @transactional
    def param_versions(self, run_id: int, limit: int, *, conn: Connection | None = None) -> list[ParamVersion]:
        """Published parameter versions, newest first."""
        with self.tx(conn) as conn:
            load_run(conn, run_id, lock=False)
            rows = conn.execute(queries.text("param_versions"), {"run": run_id, "n": limit}).all()
        return [ParamVersion(**r._mapping) for r in rows]

    @transactional
    def instance_owner(self, instance_id: int, *, conn: Connection | None = None) -> InstanceOwner | None:
        """The run and registering token of an instance; None if there is no such instance."""
        with self.tx(conn) as conn:
            row = conn.execute(queries.text("instance_owner"), {"i": instance_id}).first()
        return None if row is None else InstanceOwner(row.run_id, row.token_id)

    @transactional
    def audit(
        self, view: str, run_id: int | None, limit: int, offset: int, *, conn: Connection | None = None
    ) -> list[dict[str, Any]]:
        """Rows of an audit view (`AUDIT_VIEWS`), by column name."""
        if view not in AUDIT_VIEWS:
            raise KeyError(view)
        name = f"audit_{view}" if run_id is None else f"audit_{view}_of_run"
        with self.tx(conn) as conn:
            rows = conn.execute(queries.text(name), {"run": run_id, "n": limit, "o": offset}).all()
        return [dict(r._mapping) for r in rows]

    @transactional
    def lineage(
        self, run_id: int, step: int, sample_id: int | None = None, *, conn: Connection | None = None
    ) -> list[dict[str, Any]]:
        """`trained_lineage` rows of a trained step (one sample's, when given): per segment its
        version, instance, published checksum and the reward with its scorer. NotFound for a
        step (or a sample of it) that did not train."""
        with self.tx(conn) as conn:
            load_run(conn, run_id, lock=False)
            rows = _rows(conn, "lineage_of_step", run=run_id, step=step, sample=sample_id)
        if not rows:
            what = f"step {step} of run {run_id}" if sample_id is None else f"sample {sample_id} at step {step}"
            raise NotFound(f"trained {what}")
        return rows

    @transactional
    def export_page(
        self, run_id: int, after: int, limit: int, trained: bool, *, conn: Connection | None = None
    ) -> list[dict[str, Any]]:
        """Up to `limit` of a run's samples with id > `after`, in id order, each with its tokens,
        log-probs, loss mask, versions, reward and timings (`export_samples`)."""
        with self.tx(conn) as conn:
            load_run(conn, run_id, lock=False)
            rows = _rows(conn, "export_samples", run=run_id, after=after, n=limit, trained=trained)
        if any(url is not None for r in rows for url in r["seg_urls"]):  # read through the payload store
            from ..payload_store import fill_offloaded

            fill_offloaded(rows)
        return [_export_row(r) for r in rows]

    @transactional
    def export_count(self, run_id: int, trained: bool, *, conn: Connection | None = None) -> int:
        with self.tx(conn) as conn:
            load_run(conn, run_id, lock=False)
            return int(conn.execute(queries.text("export_count"), {"run": run_id, "trained": trained}).scalar_one())

    def schema_revision(self) -> str | None:
        """The migration the database is at (readiness: it must be the newest one)."""
        with self.engine.connect() as c:
            return c.execute(queries.text("schema_revision")).scalar()

    def metrics_rows(self, max_runs: int = 50, recent_cycles: int = 100) -> MetricsRows:
        """Figures for /metrics, for the newest runs; one read-only transaction."""
        with self.engine.connect() as c, c.begin():
            c.execute(queries.text("read_only"))
            runs = [RunRow(**r._mapping) for r in c.execute(queries.text("metrics_runs"), {"n": max_runs}).all()]
            by_run = {"ids": [r.id for r in runs]}
            queued = c.execute(queries.text("metrics_queued"), by_run).all()
            buffers = c.execute(queries.text("metrics_buffers"), by_run).all()
            staleness = c.execute(queries.text("metrics_staleness"), by_run).all()
            instances = c.execute(queries.text("metrics_instances"), by_run).all()
            dropped = c.execute(queries.text("metrics_dropped"), by_run).all()
            cycles = c.execute(queries.text("metrics_cycles"), by_run | {"recent": recent_cycles}).all()
            lock_waits = c.execute(queries.text("metrics_lock_waits")).all()
        return MetricsRows(runs, queued, buffers, staleness, instances, dropped, cycles, lock_waits)

    def status(self, run_id: int) -> dict[str, Any]:
        """Versions, buffers and in-flight counts, from one consistent read-only view."""
        with self.engine.connect() as conn, conn.begin():
            conn.execute(queries.text("read_only_snapshot"))
            info = self.get_run(run_id, conn=conn)
            run = RunRow.of({"id": info.id, "version": info.version, "state": info.state, **info.config})
            buffers = read_buffers(conn, run_id, max(0, run.version - 1))
            by_run = {"run": run_id}
            samples: dict[str, int] = dict(conn.execute(queries.text("status_samples"), by_run).all())
            groups: dict[str, int] = dict(conn.execute(queries.text("status_groups"), by_run).all())
            queued = conn.execute(queries.text("status_queued"), by_run).all()
            instances = conn.execute(queries.text("status_instances"), by_run).scalar()
        return {
            "run_id": run_id,
            "name": info.name,
            "state": info.state,
            "state_reason": info.state_reason,
            "version": run.version,
            "config": run.as_dict(),
            "buffers": [
                {"index": b.index, "occupied": b.occupied, "reserved": b.reserved, "state": buffer_state(b, run.limits)}
                for b in buffers
            ],
            "samples": samples,
            "groups": groups,
            "queued_by_version": [{"v_traj": v, "count": n} for v, n in queued],
            "active_instances": instances,
        }

    def dashboard(self, run_id: int, panels: Sequence[str] = DASHBOARD_PANELS, steps: int = 200) -> dict[str, Any]:
        """The run and the named panels (`DASHBOARD_PANELS`, plus "audit": the complete audit,
        which scans every segment, so callers ask for it sparingly); one snapshot of the run."""
        with self.engine.connect() as c, c.begin():
            c.execute(queries.text("read_only_snapshot"))
            run = load_run(c, run_id, lock=False)
            row = c.execute(queries.text("dashboard_run"), {"run": run_id}).one()
            out: dict[str, Any] = {
                "run": {
                    "id": run.id,
                    "name": row.name,
                    "created_at": row.created_at,
                    "version": run.version,
                    "state": run.state,
                }
                | run.as_dict()
            }
            for panel in panels:
                if panel not in _PANEL_QUERIES:
                    raise ValueError(f"no dashboard panel {panel!r}")
                rows = {name: _rows(c, f"panel_{panel}_{name}", run=run_id, n=steps) for name in _PANEL_QUERIES[panel]}
                shape = _PANEL_SHAPES.get(panel)
                out[panel] = shape(rows) if shape else rows
        return out
