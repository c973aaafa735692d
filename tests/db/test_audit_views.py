"""The complete audit on healthy runs (no false positives, also between any two protocol
transactions), its migration (0002 creates it, the downgrade restores 0001's view), and a
plan guard: on a populated database every branch reads only the audited run's rows and none
runs a subquery per row."""

from __future__ import annotations

import json

from audit_helpers import healthy_run, state
from sqlalchemy import text

from staleflow_db import migrate
from staleflow_db.audit import summary, violations
from workers.wire.enums import DropReason, GroupState


def test_a_healthy_run_audits_empty_after_every_operation(engine):
    """B' > B, N' > N, surplus / user / group / window-ready aborts, a DAPO filter with its
    replacement, interrupts and migration, an instance expiring (and lapsing before the sweep),
    a clean deregistration, a version raise, and four published versions."""
    runs = []

    def clean():
        for run in runs:
            assert violations(engine, run) == []

    h = healthy_run(engine, check=clean)
    runs.append(h.run)
    d, p = h.d, h.d.p
    clean()
    assert p.abort_samples(h.run, [h.m("g5r", 0)], DropReason.USER) == [h.m("g5r", 0)]  # 2 live left: N = 2
    clean()
    assert p.abort_group(h.run, h.groups["g6"]) is True
    clean()
    assert p.abort_after_ready(h.run) == [h.groups["g3"]]  # buffer 2 ready: g3's window [1, 2] is full
    clean()
    d.train(2)
    clean()
    g5r = h.members["g5r"][1:]
    d.routed(g5r, h.inst["i2"])  # V 2 at run version 3: reserves buffer 3
    clean()
    with engine.begin() as c:  # i2's lease lapses; until a sweep fences it, it is still active
        c.execute(
            text("UPDATE instances SET lease_expires_at = now() - interval '1 s' WHERE id = :i"), {"i": h.inst["i2"]}
        )
    clean()
    assert p.expire_instances(h.run) == [h.inst["i2"]]  # its samples go back to the queue
    clean()
    assert p.deregister_instance(h.inst["i0"]) == []
    clean()
    i3 = p.register_instance(h.run, "i3", 3)
    routed = d.routed(g5r, i3)  # no tokens yet: version raise to 3, joins the reservation in buffer 3
    assert {r[1] for r in state(engine, "SELECT id, v_traj FROM samples WHERE id = ANY(:s)", s=g5r)} == {3}
    clean()
    d.finish(routed, version=3)
    (outcome,) = d.reward_all(rewards={g5r[0]: 0.0, g5r[1]: 1.0})
    assert outcome.state == GroupState.OCCUPIED
    clean()
    d.train(3)
    clean()
    data = summary(engine, h.run)
    assert data["version"] == 4 and data["violations"] == []
    assert [s["step"] for s in data["steps"]] == [0, 1, 2, 3]
    assert {x["reason"] for x in data["drops"]} == {"surplus", "filtered", "user", "window_ready"}


def test_audit_view_columns_are_unchanged(engine):
    with engine.connect() as c:
        cols = c.execute(
            text(
                "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = 'staleness_violations'"
                " ORDER BY ordinal_position"
            )
        ).all()
    assert cols == [("run_id", "bigint"), ("invariant", "text"), ("subject", "text"), ("detail", "text")]


def _view_sql(engine, view: str = "staleness_violations") -> str | None:
    with engine.connect() as c:
        return c.execute(text("SELECT pg_get_viewdef(to_regclass(:v))"), {"v": view}).scalar()


def _complete(engine) -> bool:
    """The complete audit: audit_v2's view and the lineage checks, unioned."""
    top = _view_sql(engine)
    v2, lineage = _view_sql(engine, "staleness_violations_v2"), _view_sql(engine, "lineage_violations")
    return (
        "staleness_violations_v2" in top
        and "lineage_violations" in top
        and "conservation" in v2
        and all(k in lineage for k in ("trained_once", "segment_lineage", "segment_count", "group_version"))
    )


def test_downgrade_restores_the_initial_view_and_upgrade_brings_the_complete_one_back(engine, db_url):
    assert _complete(engine)
    migrate.downgrade(db_url, "0006")  # audit_v2's view alone, under its own name again
    assert "conservation" in _view_sql(engine) and "trained_once" not in _view_sql(engine)
    assert _view_sql(engine, "lineage_violations") is None and _view_sql(engine, "staleness_violations_v2") is None
    migrate.downgrade(db_url, "0001")
    initial = _view_sql(engine)
    assert "conservation" not in initial and "'lost'" in initial
    migrate.upgrade(db_url, "head")
    assert _complete(engine)


# ---- plan guard ---------------------------------------------------------------------------------

POPULATE = """
INSERT INTO runs (name, batch_size, buffer_capacity, group_size, samples_per_group, eta,
                  max_response_tokens, max_prompt_tokens, dapo_filter, version)
SELECT 'plan-' || r, 16, 16, 4, 4, 2, 100000, 1024, false, 40 FROM generate_series(1, 3) r;
INSERT INTO instances (run_id, name, version, lease_expires_at)
SELECT r.id, 'i' || i, 40, now() + interval '1 hour' FROM runs r, generate_series(1, 4) i;
INSERT INTO buffers (run_id, idx, batch_size, capacity, occupied, reserved, consumed_at)
SELECT r.id, x, 16, 16, 16, 0, now() FROM runs r, generate_series(0, 39) x;
INSERT INTO param_versions (run_id, version) SELECT r.id, x FROM runs r, generate_series(1, 40) x;
INSERT INTO events (run_id, kind, buffer) SELECT r.id, 'published', x FROM runs r, generate_series(0, 39) x;
INSERT INTO prompt_groups (run_id, client_key, prompt_tokens, state, min_version, buffer, group_version)
SELECT r.id, 'k' || x || '-' || j, ARRAY[1, 2, 3], 'consumed', x, x, x
FROM runs r, generate_series(0, 39) x, generate_series(1, 16) j;
INSERT INTO events (run_id, kind, group_id) SELECT run_id, 'group_enqueued', id FROM prompt_groups;
INSERT INTO events (run_id, kind, group_id, buffer, data)
SELECT run_id, 'group_occupied', id, buffer, jsonb_build_object('version', group_version) FROM prompt_groups;
INSERT INTO samples (run_id, group_id, idx, state, v_traj, attempt, n_tokens, n_segments, last_version, reward)
SELECT g.run_id, g.id, i, 'rewarded', g.buffer, 1, 12, 3, g.buffer, 1.0 FROM prompt_groups g, generate_series(0, 3) i;
INSERT INTO segments (sample_id, seq, run_id, version, instance_id, attempt, token_ids, logprobs, n_tokens)
SELECT s.id, q, s.run_id, s.v_traj, 1, 1, decode('01000000020000000300000004000000', 'hex'),
  decode('000080bf000080bf000080bf000080bf', 'hex'), 4
FROM samples s, generate_series(0, 2) q;
INSERT INTO events (run_id, kind, sample_id, instance_id, data)
SELECT run_id, 'sample_routed', id, 1, jsonb_build_object('v', v_traj) FROM samples;
ANALYZE;
"""

RUN_SCOPED = {"samples", "segments", "prompt_groups", "buffers", "events", "param_versions", "runs", "instances"}


def _nodes(node):
    yield node
    for child in node.get("Plans", []):
        yield from _nodes(child)


def test_plan_every_branch_reads_only_the_audited_run_and_nothing_per_row(engine):
    """3 runs x 640 groups x 4 samples x 3 segments, all healthy: auditing one run returns
    nothing, and no subquery in its plan scans a table per row (the one SubPlan, which builds the
    detail of a reported row, probes the primary key); every scan of a run-scoped table
    is either restricted to the run (its filter or index condition names run_id or the run's
    id) or an index probe by key from a row already restricted (a join on id)."""
    with engine.begin() as c:
        c.execute(text(POPULATE))
    run = state(engine, "SELECT min(id) FROM runs")[0][0]
    assert violations(engine, run) == []
    with engine.connect() as c:
        (plan,) = c.execute(
            text("EXPLAIN (FORMAT JSON) SELECT * FROM staleness_violations WHERE run_id = :r"), {"r": run}
        ).scalar()
    if isinstance(plan, str):
        plan = json.loads(plan)[0]
    nodes = list(_nodes(plan["Plan"]))
    for sub in (n for n in nodes if n.get("Parent Relationship") == "SubPlan"):  # only index probes by key
        assert all(x["Node Type"] != "Seq Scan" for x in _nodes(sub)), sub
    for n in nodes:
        table = n.get("Relation Name")
        if table not in RUN_SCOPED or not n["Node Type"].endswith("Scan"):
            continue
        conds = " ".join(str(n.get(k, "")) for k in ("Filter", "Index Cond", "Recheck Cond", "Join Filter"))
        restricted = "run_id" in conds or (table == "runs" and "id =" in conds)
        by_key = (n["Node Type"] in ("Index Scan", "Index Only Scan") and "Index Cond" in n) or (
            n["Node Type"] == "Bitmap Heap Scan" and "Recheck Cond" in n
        )
        assert restricted or by_key, (table, n["Node Type"], conds)
