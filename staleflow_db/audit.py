"""Read the audit views back as plain data: what trained at each step with what staleness,
what was dropped and why, and any invariant violation."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from sqlalchemy import Engine, text

from .errors import NotFound


def find_run(engine: Engine, run: str | int) -> int:
    """A run by id or by name."""
    with engine.connect() as c:
        row = c.execute(
            text("SELECT id FROM runs WHERE id::text = :r OR name = :r ORDER BY (id::text = :r) DESC LIMIT 1"),
            {"r": str(run)},
        ).first()
    if row is None:
        raise NotFound(f"run {run}")
    return row[0]


def summary(engine: Engine, run_id: int) -> dict[str, Any]:
    """Everything `staleflow audit` prints, from one read-only transaction."""
    with engine.connect() as c, c.begin():
        c.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY"))
        run = c.execute(
            text("SELECT name, version, eta, batch_size, group_size FROM runs WHERE id = :r"), {"r": run_id}
        ).first()
        if run is None:
            raise NotFound(f"run {run_id}")
        hist = c.execute(
            text(
                "SELECT step, staleness, count(*), sum(n_tokens), avg(reward) FROM trained_samples WHERE run_id = :r"
                " GROUP BY step, staleness ORDER BY step, staleness"
            ),
            {"r": run_id},
        ).all()
        drops = c.execute(
            text(
                "SELECT reason, count(*), coalesce(sum(n_tokens), 0) FROM dropped_samples WHERE run_id = :r"
                " GROUP BY reason ORDER BY count(*) DESC"
            ),
            {"r": run_id},
        ).all()
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
        c.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY"))
        return _violations(c, run_id)


def _violations(conn, run_id: int) -> list[dict[str, str]]:
    rows = conn.execute(
        text(
            "SELECT invariant, subject, detail FROM staleness_violations WHERE run_id = :r"
            " ORDER BY invariant, subject, detail"
        ),
        {"r": run_id},
    ).all()
    return [{"invariant": i, "subject": s, "detail": d} for i, s, d in rows]


def step_metrics(engine: Engine, run_id: int) -> list[dict[str, Any]]:
    """Per published step: when it was published, what it trained (samples, tokens, reward,
    staleness histogram) and what the system did in between (routes, interrupts, pulls,
    migrations) — the per-step table of a run report."""
    with engine.connect() as c, c.begin():
        c.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY"))
        start = c.execute(text("SELECT created_at FROM runs WHERE id = :r"), {"r": run_id}).scalar()
        published = c.execute(
            text("SELECT buffer, at FROM events WHERE run_id = :r AND kind = 'published' ORDER BY buffer"),
            {"r": run_id},
        ).all()
        trained = summary(engine, run_id)["steps"]
        counts = c.execute(
            text(
                "SELECT at, kind FROM events WHERE run_id = :r"
                " AND kind IN ('sample_routed', 'sample_interrupted') ORDER BY at"
            ),
            {"r": run_id},
        ).all()
        pulls = (
            c.execute(
                text("SELECT created_at FROM commands WHERE run_id = :r AND kind = 'pull' ORDER BY created_at"),
                {"r": run_id},
            )
            .scalars()
            .all()
        )
        migrations = c.execute(
            text("SELECT at, migrated FROM coordinator_cycles WHERE run_id = :r AND migrated > 0 ORDER BY at"),
            {"r": run_id},
        ).all()
    by_step = {s["step"]: s for s in trained}
    rows, prev = [], start
    for step, at in published:
        window = lambda t: prev < t <= at  # noqa: E731 - one window per step
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
