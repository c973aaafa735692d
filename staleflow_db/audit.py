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
        run = c.execute(text("SELECT name, version, eta, batch_size, group_size FROM runs WHERE id = :r"), {"r": run_id}).first()
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
        violations = c.execute(
            text("SELECT invariant, subject, detail FROM staleness_violations WHERE run_id = :r"), {"r": run_id}
        ).all()
    steps: dict[int, dict[str, Any]] = defaultdict(lambda: {"staleness": {}, "samples": 0, "tokens": 0, "reward_sum": 0.0})
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
            {"step": k, "samples": v["samples"], "tokens": v["tokens"], "mean_reward": v["reward_sum"] / v["samples"],
             "staleness": v["staleness"]}
            for k, v in sorted(steps.items())
        ],
        "drops": [{"reason": r, "samples": n, "tokens": int(t)} for r, n, t in drops],
        "violations": [{"invariant": i, "subject": s, "detail": d} for i, s, d in violations],
    }
