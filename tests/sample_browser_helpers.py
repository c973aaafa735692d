"""A run with one sample of each kind the sample browser shows, driven through the protocol on a
real database: a trained single-turn sample (A), a trained multi-turn sample interrupted on one
instance and migrated to another across a publish (B), a dropped one (C), one in flight (D).
Tokens are UTF-8 bytes, so the browser decodes them to text."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

from api.auth import create_token
from staleflow_db.audit import violations
from staleflow_db.protocol import Prompt, Protocol
from staleflow_db.types import Report, RunConfig
from workers.wire.enums import SegmentKind as K

# B's segments: (text, generated, version); turn 1 spans an interruption and a migration
B_TURN1 = ("The answer", " is", " 4.")
B_OBSERVATION = "\nuser: sure?\n"
B_TURN2 = "Yes."


def utf8(s: str) -> list[int]:
    return list(s.encode())


def ident(engine: Any, sid: int) -> dict[str, Any]:
    with engine.connect() as c:
        i, tok = c.execute(text("SELECT instance_id, route_token FROM samples WHERE id = :s"), {"s": sid}).one()
    return {"instance_id": i, "route_token": str(tok)}


def _member(engine: Any, group: int) -> int:
    with engine.connect() as c:
        return int(c.execute(text("SELECT id FROM samples WHERE group_id = :g"), {"g": group}).scalar_one())


def browsable_run(engine: Any) -> dict[str, Any]:
    """The run and its samples' ids (a, b, c, d), instances (i0, i1), the scorer token's id."""
    p = Protocol(engine)
    cfg = RunConfig(batch_size=1, group_size=1, samples_per_group=1, eta=2, max_response_tokens=64)
    run = p.create_run("browse", cfg)
    ga, gb, gc, gd = p.enqueue(run, [Prompt(k, utf8(f"Q{k}: 2+2?")) for k in "abcd"])
    a, b, c, d = (_member(engine, g) for g in (ga, gb, gc, gd))
    judge = create_token(engine, "reward", run, name="judge")
    i0 = p.register_instance(run, "gpu-0", 0)

    def report(sid: int, version: int | None, s: str, kind: K, generated: bool = True) -> None:
        lp = [-0.5] * len(utf8(s)) if generated else []
        p.report(
            run, [Report(sid, attempt(engine, sid), version, utf8(s), lp, kind, None, generated, **ident(engine, sid))]
        )

    def score(rewards: dict[int, tuple[float, dict[str, float] | None]]) -> None:
        tasks = p.claim_rewards(run, 10)
        assert {t.sample_id for t in tasks} == set(rewards), tasks
        rows = [(t.sample_id, t.reward_attempt, *rewards[t.sample_id]) for t in tasks]
        p.record_rewards(run, rows, scorer=judge["id"])

    # A: one turn at version 0, trained at step 0 (which publishes version 1)
    p.route(run, [(a, i0)])
    report(a, 0, "4", K.FINISHED)
    score({a: (1.0, {"accuracy": 1.0})})
    # B: its first turn starts on gpu-0 at version 0 and is interrupted by the coordinator
    p.route(run, [(b, i0)])
    report(b, 0, B_TURN1[0], K.PARTIAL)
    assert p.interrupt(run, [b]) == 1
    report(b, 0, B_TURN1[1], K.INTERRUPTED)
    batch = p.consume(run, 0)
    assert batch is not None
    p.publish(run, 0, batch.consume_fence, 10, "sha256:v1", "ps://1")
    # ... and resumes on gpu-1 at version 1 (a migration), then an observation, then turn 2
    i1 = p.register_instance(run, "gpu-1", 1)
    p.route(run, [(b, i1)])
    report(b, 1, B_TURN1[2], K.PARTIAL)
    report(b, None, B_OBSERVATION, K.INTERRUPTED, generated=False)
    p.route(run, [(b, i1)])
    report(b, 1, B_TURN2, K.FINISHED)
    score({b: (0.5, {"accuracy": 0.0})})
    batch = p.consume(run, 1)
    assert batch is not None
    p.publish(run, 1, batch.consume_fence, 10, "sha256:v2", "ps://2")
    # C: dropped by its environment; D: still generating
    p.route(run, [(c, i1)])
    report(c, 2, "x", K.PARTIAL)
    p.drop_trajectories(run, i1, [(c, attempt(engine, c), ident(engine, c)["route_token"])])
    p.route(run, [(d, i1)])
    report(d, 2, "thinking", K.PARTIAL)
    assert violations(engine, run) == []
    return {"run": run, "a": a, "b": b, "c": c, "d": d, "i0": i0, "i1": i1, "scorer": judge["id"]}


def attempt(engine: Any, sid: int) -> int:
    with engine.connect() as c:
        return int(c.execute(text("SELECT attempt FROM samples WHERE id = :s"), {"s": sid}).scalar_one())
