"""Read the audit views back as plain data: what trained at each step with what staleness,
what was dropped and why, and any invariant violation."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine

from . import queries
from .errors import NotFound
from .payload_store import payload_violations
from .protocol.reads import ProtocolReads


def find_run(engine: Engine, run: str | int) -> int:
    """A run by id or by name (the rule of `ProtocolReads.run_id`); NotFound if none."""
    reads = ProtocolReads(engine)
    run_id = reads.run_id(run)
    reads.get_run(run_id)  # NotFound for an id that is no run
    return run_id


def summary(engine: Engine, run_id: int) -> dict[str, Any]:
    """Everything `staleflow audit` prints, from one read-only transaction."""
    with engine.connect() as c, c.begin():
        c.execute(queries.text("read_only_snapshot"))
        run = c.execute(queries.text("audit_run"), {"r": run_id}).first()
        if run is None:
            raise NotFound(f"run {run_id}")
        hist = c.execute(queries.text("audit_histogram"), {"r": run_id}).all()
        drops = c.execute(queries.text("audit_drops"), {"r": run_id}).all()
        found = _violations(c, run_id)
    steps: dict[int, dict[str, Any]] = defaultdict(
        lambda: {"staleness": {}, "samples": 0, "tokens": 0, "reward_sum": 0.0}
    )
    for step, staleness, n, tokens, reward in hist:
        s = steps[step]
        s["staleness"][int(staleness)] = n
        s["samples"] += n
        s["tokens"] += int(tokens or 0)
        s["reward_sum"] += float(reward or 0) * n
    return {
        "run_id": run_id,
        "name": run[0],
        "version": run[1],
        "eta": run[2],
        "steps": [
            {
                "step": k,
                "samples": v["samples"],
                "tokens": v["tokens"],
                "mean_reward": v["reward_sum"] / v["samples"],
                "staleness": v["staleness"],
            }
            for k, v in sorted(steps.items())
        ],
        "drops": [{"reason": r, "samples": n, "tokens": int(t)} for r, n, t in drops],
        "violations": found,
    }


def violations(engine: Engine, run_id: int) -> list[dict[str, str]]:
    """Every row of `staleness_violations` for the run (empty when it is healthy), ordered by
    invariant and subject: each names the broken invariant, what breaks it and how."""
    with engine.connect() as c, c.begin():
        c.execute(queries.text("read_only_snapshot"))
        return _violations(c, run_id)


def _violations(conn: Connection, run_id: int) -> list[dict[str, str]]:
    rows = conn.execute(queries.text("audit_run_violations"), {"r": run_id}).all()
    found = [{"invariant": i, "subject": s, "detail": d} for i, s, d in rows]
    # the checks that need the payloads of offloaded segments, read through the payload store
    stored = payload_violations(conn, run_id)
    if not stored:
        return found
    return sorted(found + stored, key=lambda v: (v["invariant"], v["subject"], v["detail"]))


def step_metrics(engine: Engine, run_id: int) -> list[dict[str, Any]]:
    """Per published step: when it was published, what it trained (samples, tokens, reward,
    staleness histogram) and what the system did in between (routes, interrupts, pulls,
    migrations) — the per-step table of a run report."""
    with engine.connect() as c, c.begin():
        c.execute(queries.text("read_only_snapshot"))
        by_run = {"r": run_id}
        start: datetime | None = c.execute(queries.text("audit_run_start"), by_run).scalar()
        if start is None:
            raise NotFound(f"run {run_id}")
        published = c.execute(queries.text("audit_published"), by_run).all()
        trained = summary(engine, run_id)["steps"]
        counts = c.execute(queries.text("audit_routes_and_interrupts"), by_run).all()
        pulls = c.execute(queries.text("audit_pulls"), by_run).scalars().all()
        migrations = c.execute(queries.text("audit_migrations"), by_run).all()
    by_step = {s["step"]: s for s in trained}
    rows, prev = [], start
    step: int
    at: datetime
    for step, at in published:

        def window(t: datetime) -> bool:  # this step's window, used right here
            return prev < t <= at

        s = by_step.get(step, {"samples": 0, "tokens": 0, "mean_reward": 0.0, "staleness": {}})
        seconds = (at - prev).total_seconds()
        rows.append(
            {
                "step": step,
                "published_at": at.isoformat(),
                "seconds": seconds,
                "samples": s["samples"],
                "tokens": s["tokens"],
                "tokens_per_s": s["tokens"] / seconds if seconds > 0 else 0.0,
                "mean_reward": s["mean_reward"],
                "staleness": s["staleness"],
                "routed": sum(1 for t, k in counts if k == "sample_routed" and window(t)),
                "interrupts": sum(1 for t, k in counts if k == "sample_interrupted" and window(t)),
                "pulls": sum(1 for t in pulls if window(t)),
                "migrations": sum(m for t, m in migrations if window(t)),
            }
        )
        prev = at
    return rows


def step_accuracy(engine: Engine, run_id: int, best: float) -> dict[int, float]:
    """Per trained step: the fraction of its samples with a reward of at least `best`."""
    with engine.connect() as c:
        rows = c.execute(queries.text("step_accuracy"), {"r": run_id, "best": best}).all()
    return {int(step): float(acc) for step, acc in rows}


def last_step_reward(engine: Engine, run_id: int) -> float | None:
    """Mean reward of the last trained step (None before the first): one indexed query, not
    the full audit."""
    with engine.connect() as c:
        got = c.execute(queries.text("last_step_reward"), {"r": run_id}).scalar()
    return None if got is None else float(got)


def mean_turns(engine: Engine, run_id: int, from_step: int = 0) -> float | None:
    """Mean turns per trajectory trained at steps >= `from_step` (None before the first)."""
    with engine.connect() as c:
        got = c.execute(queries.text("mean_turns"), {"r": run_id, "from": from_step}).scalar()
    return None if got is None else float(got)
