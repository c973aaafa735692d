"""The API's own SQL: reads the protocol has no method for (run lists, audit views, metrics),
pull commands and the coordinator epoch fence. Protocol transitions stay in
`staleflow_db.protocol`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Engine, text

from staleflow_db.errors import Conflict, InvalidInput, NotFound
from staleflow_db.protocol.base import RUN_COLUMNS, RunRow, load_run, log_events

CONFIG_COLUMNS = (
    "batch_size",
    "buffer_capacity",
    "group_size",
    "samples_per_group",
    "eta",
    "max_response_tokens",
    "max_prompt_tokens",
    "dapo_filter",
)


def _run_out(row: Any) -> dict[str, Any]:
    m = row._mapping
    return {
        "id": m["id"],
        "name": m["name"],
        "version": m["version"],
        "created_at": m["created_at"],
        "config": {k: m[k] for k in CONFIG_COLUMNS},
    }


def list_runs(engine: Engine, run_id: int | None, limit: int, offset: int) -> list[dict[str, Any]]:
    where = "" if run_id is None else " WHERE id = :run"
    with engine.connect() as c:
        rows = c.execute(
            text(f"SELECT {RUN_COLUMNS}, name, created_at FROM runs{where} ORDER BY id LIMIT :n OFFSET :o"),
            {"run": run_id, "n": limit, "o": offset},
        ).all()
    return [_run_out(r) for r in rows]


def get_run(conn: Connection, run_id: int) -> dict[str, Any]:
    row = conn.execute(
        text(f"SELECT {RUN_COLUMNS}, name, created_at FROM runs WHERE id = :run"), {"run": run_id}
    ).first()
    if row is None:
        raise NotFound(f"run {run_id}")
    return _run_out(row)


def param_versions(engine: Engine, run_id: int, limit: int) -> list[dict[str, Any]]:
    with engine.connect() as c:
        load_run(c, run_id, lock=False)
        rows = c.execute(
            text(
                "SELECT version, size_bytes, checksum, location, created_at FROM param_versions"
                " WHERE run_id = :run ORDER BY version DESC LIMIT :n"
            ),
            {"run": run_id, "n": limit},
        ).all()
    return [dict(r._mapping) for r in rows]


def instance_owner(engine: Engine, instance_id: int) -> tuple[int, int | None] | None:
    """(run, registering token) of an instance, or None if there is no such instance."""
    with engine.connect() as c:
        row = c.execute(text("SELECT run_id, token_id FROM instances WHERE id = :i"), {"i": instance_id}).first()
    return None if row is None else (row[0], row[1])


def check_epoch(conn: Connection, run_id: int, epoch: int | None) -> None:
    """Refuse a write from a deposed coordinator. FOR SHARE holds off a takeover until commit."""
    if epoch is None:
        return
    current = conn.execute(
        text("SELECT epoch FROM coordinator_leases WHERE run_id = :run AND expires_at > now() FOR SHARE"),
        {"run": run_id},
    ).scalar()
    if current != epoch:
        raise Conflict([(epoch, f"coordinator epoch {epoch} is not the run's current lease ({current})")])


def pull(conn: Connection, run: RunRow, instance_ids: Sequence[int], target: int | None, epoch: int | None) -> int:
    """Queue a pull (load newer weights) for each active instance of the run."""
    target = run.version if target is None else target
    if target > run.version:
        raise InvalidInput(f"target_version {target} is newer than the run's version {run.version}")
    ids = sorted(set(instance_ids))
    found = conn.execute(
        text("SELECT id, state FROM instances WHERE run_id = :run AND id = ANY(CAST(:ids AS bigint[]))"),
        {"run": run.id, "ids": ids},
    ).all()
    missing = set(ids) - {r[0] for r in found}
    if missing:
        raise NotFound(f"instance {min(missing)} in run {run.id}")
    active = [r[0] for r in found if r[1] == "active"]
    if active:
        conn.execute(
            text(
                "INSERT INTO commands (run_id, instance_id, kind, target_version, epoch)"
                " SELECT :run, i, 'pull', :v, :epoch FROM unnest(CAST(:ids AS bigint[])) AS i"
            ),
            {"run": run.id, "ids": active, "v": target, "epoch": epoch},
        )
        log_events(conn, run.id, [("pull", None, None, None, i, {"target": target}) for i in active])
    return len(active)


AUDIT_VIEWS = {
    "trained": ("trained_samples", "step, sample_id"),
    "dropped": ("dropped_samples", "sample_id"),
    "violations": ("staleness_violations", "invariant, subject"),
}


def audit(engine: Engine, view: str, run_id: int | None, limit: int, offset: int) -> list[dict[str, Any]]:
    name, order = AUDIT_VIEWS[view]
    where = "" if run_id is None else " WHERE run_id = :run"
    with engine.connect() as c:
        rows = c.execute(
            text(f"SELECT * FROM {name}{where} ORDER BY run_id, {order} LIMIT :n OFFSET :o"),
            {"run": run_id, "n": limit, "o": offset},
        ).all()
    return [dict(r._mapping) for r in rows]


def metrics_rows(engine: Engine, max_runs: int = 50) -> dict[str, list[Any]]:
    """Figures for /metrics, for the newest runs; one read-only transaction."""
    with engine.connect() as c, c.begin():
        c.execute(text("SET TRANSACTION READ ONLY"))
        runs = c.execute(text(f"SELECT {RUN_COLUMNS} FROM runs ORDER BY id DESC LIMIT :n"), {"n": max_runs}).all()
        ids = [r[0] for r in runs]
        queued = c.execute(
            text(
                "SELECT run_id, v_traj, count(*) FROM samples WHERE state = 'queued'"
                " AND run_id = ANY(CAST(:ids AS bigint[])) GROUP BY 1, 2"
            ),
            {"ids": ids},
        ).all()
        buffers = c.execute(
            text(
                "SELECT b.run_id, b.idx, b.occupied, b.reserved, b.consumed_at IS NOT NULL FROM buffers b"
                " JOIN runs r ON r.id = b.run_id WHERE b.run_id = ANY(CAST(:ids AS bigint[])) AND b.idx >= r.version"
            ),
            {"ids": ids},
        ).all()
        staleness = c.execute(
            text(
                "SELECT s.run_id, g.buffer - s.v_traj, count(*) FROM samples s JOIN prompt_groups g ON g.id = s.group_id"
                " WHERE g.state = 'consumed' AND s.state = 'rewarded' AND s.run_id = ANY(CAST(:ids AS bigint[]))"
                " GROUP BY 1, 2"
            ),
            {"ids": ids},
        ).all()
    return {"runs": [RunRow(*r) for r in runs], "queued": queued, "buffers": buffers, "staleness": staleness}
