"""Plan guards: with a large backlog, every claim query reads its partial index.

The statements checked are the ones the protocol really sends: each operation runs once with
a SQLAlchemy cursor hook recording its SQL and parameters, then the matching statement is
EXPLAINed with those same parameters (EXPLAIN without ANALYZE executes nothing). The
databases are built once per module with set-based SQL and ANALYZEd before any plan is taken:
a backlog (4 runs x 18k samples, mostly queued or finished, two segments for each sample past
queued, as a busy server would hold) and a young run (most of its samples in flight).
"""

from __future__ import annotations

import re
import uuid
from contextlib import contextmanager

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import text
from statement_recorder import recording

from staleflow_db.db import make_engine, with_database
from staleflow_db.protocol import Protocol

RUNS, GROUPS_PER_RUN, SAMPLES_PER_GROUP, INSTANCES_PER_RUN = 4, 4500, 4, 8

# Sample states by `n % 20` of the sample's number within its run: a backlog that is mostly
# queued and finished (what the claim queries look for), some terminal, a thin in-flight set.
BACKLOG_SQL = """
INSERT INTO runs (name, batch_size, buffer_capacity, group_size, samples_per_group, eta,
                  max_response_tokens, max_prompt_tokens, dapo_filter)
SELECT 'plans-' || r, 64, 64, 4, 4, 2, 1024, 1024, false FROM generate_series(1, :runs) r;

INSERT INTO instances (run_id, name, version, lease_expires_at)
SELECT r.id, 'inst-' || i, 0, now() + interval '1 hour'
FROM runs r, generate_series(1, :instances) i;

INSERT INTO prompt_groups (run_id, client_key, prompt_tokens, state, reserved_buffer, min_version)
SELECT r.id, 'k' || g, ARRAY[1, 2, 3], 'reserved', 0, 0
FROM runs r, generate_series(1, :groups) g;

WITH inst AS (SELECT run_id, array_agg(id ORDER BY id) AS ids FROM instances GROUP BY run_id),
     s AS (SELECT g.run_id, g.id AS group_id, i AS idx,
                  row_number() OVER (PARTITION BY g.run_id ORDER BY g.id, i) AS n
           FROM prompt_groups g, generate_series(0, :per_group - 1) i)
INSERT INTO samples (run_id, group_id, idx, state, v_traj, attempt, instance_id, delivered,
                     reward, reward_deadline, reason)
SELECT s.run_id, s.group_id, s.idx, st.state::sample_state,
       CASE WHEN st.state IN ('queued', 'aborted') THEN NULL ELSE 0 END,
       CASE WHEN st.state = 'queued' THEN 0 ELSE 1 END,
       CASE WHEN st.state = 'running' THEN inst.ids[1 + s.n % cardinality(inst.ids)] END,
       st.state = 'running' AND s.n % 40 <> 12,
       CASE WHEN st.state = 'rewarded' THEN 1.0 END,
       CASE WHEN st.state = 'scoring' THEN now() + CASE WHEN s.n % 3 = 0 THEN interval '-1 minute'
                                                        ELSE interval '1 hour' END END,
       CASE WHEN st.state = 'aborted' THEN 'surplus' END
FROM s JOIN inst USING (run_id),
LATERAL (SELECT CASE WHEN s.n % 20 < 8 THEN 'queued' WHEN s.n % 20 < 14 THEN 'finished'
                     WHEN s.n % 20 = 14 THEN 'scoring' WHEN s.n % 20 = 15 THEN 'running'
                     WHEN s.n % 20 < 19 THEN 'rewarded' ELSE 'aborted' END AS state) st;

INSERT INTO commands (run_id, instance_id, kind, sample_id, attempt, state, delivered_at)
SELECT s.run_id, s.instance_id, 'interrupt', s.id, s.attempt,
       CASE WHEN s.id % 10 = 0 THEN 'pending' ELSE 'delivered' END::command_state,
       CASE WHEN s.id % 10 = 0 THEN NULL ELSE now() END
FROM samples s, generate_series(1, 4) rep WHERE s.state = 'running';

INSERT INTO segments (sample_id, seq, run_id, version, instance_id, attempt, token_ids, logprobs, n_tokens)
SELECT s.id, q, s.run_id, 0, i.id, s.attempt, decode('01000000', 'hex'), decode('00000000', 'hex'), 1
FROM samples s JOIN LATERAL (SELECT min(id) AS id FROM instances WHERE run_id = s.run_id) i ON true,
     generate_series(0, 1) q
WHERE s.state NOT IN ('queued', 'aborted');
"""


@contextmanager
def database_of(admin_url: str, template_db: str, build_sql: str, params: dict):
    """An engine on a fresh database built by `build_sql` (statements split on ';') and
    ANALYZEd, dropped afterwards."""
    name = f"sf_plans_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name), sql.Identifier(template_db))
        )
    engine = make_engine(with_database(admin_url, name))
    try:
        with engine.begin() as conn:
            for stmt in filter(str.strip, build_sql.split(";")):
                conn.execute(text(stmt), params)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("ANALYZE"))
        yield engine
    finally:
        engine.dispose()
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture(scope="module")
def backlog(admin_url: str, template_db: str):
    """(engine, run, instance) on a database holding the backlog, dropped afterwards."""
    params = {
        "runs": RUNS,
        "instances": INSTANCES_PER_RUN,
        "groups": GROUPS_PER_RUN,
        "per_group": SAMPLES_PER_GROUP,
    }
    with database_of(admin_url, template_db, BACKLOG_SQL, params) as engine:
        with engine.connect() as conn:
            run = conn.execute(text("SELECT id FROM runs ORDER BY id OFFSET 1 LIMIT 1")).scalar()
            inst = conn.execute(text("SELECT min(id) FROM instances WHERE run_id = :r"), {"r": run}).scalar()
            counts = dict(conn.execute(text("SELECT state::text, count(*) FROM samples GROUP BY 1")).all())
        assert counts["queued"] + counts["finished"] >= 40_000, counts
        yield engine, run, inst


@contextmanager
def recorded(engine):
    """Every (statement, parameters) the engine sends while the block runs, those sent on the
    psycopg connection itself (`protocol.driver`, a pipeline) too."""
    sent: list[tuple[str, object]] = []
    with recording(engine, lambda conn, statement, parameters: sent.append((statement, parameters))):
        yield sent


# A prepared statement's plan: one for its values, or the generic one that knows nothing of
# them (STALEFLOW_PLAN_CACHE_MODE's default; `auto` switches to it after 5 executions when it
# looks no costlier)
PLAN_MODES = pytest.mark.parametrize("plan_mode", ["force_custom_plan", "force_generic_plan"])


def plan_of(engine, statement: str, parameters, plan_mode: str = "force_custom_plan") -> dict:
    """The plan of `statement` prepared as the driver prepares it, executed with `parameters`
    under `plan_mode` (PostgreSQL's plan_cache_mode)."""
    with engine.connect() as conn:
        names: list[str] = []

        def positional(m: re.Match) -> str:
            if m.group(1) not in names:
                names.append(m.group(1))
            return f"${names.index(m.group(1)) + 1}"

        prepared = re.sub(r"%\((\w+)\)s", positional, statement)
        raw = conn.connection.driver_connection
        values = ", ".join(sql.Literal(parameters[n]).as_string(raw) for n in names)
        conn.exec_driver_sql(f"SET plan_cache_mode = {plan_mode}")
        conn.exec_driver_sql("PREPARE plan_probe AS " + prepared)
        try:
            execute = f"EXECUTE plan_probe({values})" if names else "EXECUTE plan_probe"
            return conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {execute}".replace("%", "%%")).scalar()[0]["Plan"]
        finally:
            conn.exec_driver_sql("DEALLOCATE plan_probe")
            conn.exec_driver_sql("RESET plan_cache_mode")  # the pooled connection's own again


def nodes(plan: dict):
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


def describe(plan: dict, depth: int = 0) -> str:
    line = "  " * depth + " ".join(str(plan.get(k, "")) for k in ("Node Type", "Relation Name", "Index Name"))
    return "\n".join([line] + [describe(c, depth + 1) for c in plan.get("Plans", [])])


def sent_by(engine, call, marker: str) -> tuple[str, object]:
    with recorded(engine) as sent:
        call()
    matches = [s for s in sent if marker in s[0]]
    assert len(matches) == 1, f"{marker!r} matched {len(matches)} of the statements sent: {[s for s, _ in sent]}"
    return matches[0]


def _snapshot(p: Protocol, run: int, inst: int) -> None:
    if not hasattr(p, "snapshot"):
        pytest.skip("Protocol has no coordinator snapshot yet")
    p.snapshot(run)


def _node_poll(p: Protocol, inst: int) -> None:
    with p.engine.begin() as conn:
        p.poll_node([inst, inst + 1], conn=conn)


# (id, the operation, a substring that picks its claim statement, the index it must read, table)
CASES = [
    (
        "claim-rewards",
        lambda p, run, inst: p.claim_rewards(run, 100),
        "AND state = 'finished'",
        "ix_samples_finished",
        "samples",
    ),
    (
        "claim-rewards-expired",
        lambda p, run, inst: p.claim_rewards(run, 100),
        "state = 'scoring' AND reward_deadline <= now()",
        "ix_samples_scoring",
        "samples",
    ),
    (
        "claim-idle",
        lambda p, run, inst: p.claim_idle(run),
        "state = 'finished' ORDER BY id LIMIT 1",
        "ix_samples_finished",
        "samples",
    ),
    ("poll-work-samples", lambda p, run, inst: p.poll_work(inst), "NOT delivered", "ix_samples_running", "samples"),
    (
        "poll-work-commands",
        lambda p, run, inst: p.poll_work(inst),
        "FROM commands WHERE instance_id",
        "ix_commands_pending",
        "commands",
    ),
    ("node-poll-samples", lambda p, run, inst: _node_poll(p, inst), "NOT delivered", "ix_samples_running", "samples"),
    (
        "node-poll-commands",
        lambda p, run, inst: _node_poll(p, inst),
        "FROM commands c WHERE c.instance_id",
        "ix_commands_pending",
        "commands",
    ),
    (
        "node-poll-idle-samples",
        lambda p, run, inst: p.poll_node_idle([inst, inst + 1]),
        "NOT delivered",
        "ix_samples_running",
        "samples",
    ),
    (
        "node-poll-idle-commands",
        lambda p, run, inst: p.poll_node_idle([inst, inst + 1]),
        "FROM commands c WHERE c.instance_id = i.id",
        "ix_commands_pending",
        "commands",
    ),
    ("poll-idle-samples", lambda p, run, inst: p.poll_idle(inst), "NOT delivered", "ix_samples_running", "samples"),
    (
        "poll-idle-commands",
        lambda p, run, inst: p.poll_idle(inst),
        "FROM commands c WHERE",
        "ix_commands_pending",
        "commands",
    ),
    (
        "requeue-running",
        lambda p, run, inst: p.deregister_instance(inst + 1),
        "s.state = 'running' AND s.instance_id = ANY",
        "ix_samples_running",
        "samples",
    ),
    (
        "expiry-sweep",
        lambda p, run, inst: p.expire_instances(run),
        "s.state = 'running' AND i.state <> 'active'",
        "ix_samples_running",
        "samples",
    ),
    ("status-queued", lambda p, run, inst: p.reads.status(run), "state = 'queued'", "ix_samples_queued", "samples"),
    ("snapshot-queued", _snapshot, "s.state = 'queued'", "ix_samples_queued", "samples"),
]


_SENT: dict[str, tuple[str, object]] = {}  # case -> its statement: each operation runs once (they change the backlog)


@PLAN_MODES
@pytest.mark.parametrize("case, call, marker, index, table", CASES, ids=[c[0] for c in CASES])
def test_claim_statement_uses_partial_index(backlog, case, call, marker, index, table, plan_mode):
    engine, run, inst = backlog
    if case not in _SENT:
        _SENT[case] = sent_by(engine, lambda: call(Protocol(engine), run, inst), marker)
    statement, parameters = _SENT[case]
    plan = plan_of(engine, statement, parameters, plan_mode)
    used = {n.get("Index Name") for n in nodes(plan)}
    scanned = {n.get("Relation Name") for n in nodes(plan) if n["Node Type"] == "Seq Scan"}
    assert index in used and table not in scanned, f"{statement}\n{describe(plan)}"


POLLS = [c for c in CASES if c[2] == "NOT delivered"]


@PLAN_MODES
@pytest.mark.parametrize("case, call, marker, index, table", POLLS, ids=[c[0] for c in POLLS])
def test_a_poll_finds_undelivered_samples_by_the_index_key(backlog, case, call, marker, index, table, plan_mode):
    """A poll and its idle check find an instance's undelivered samples by the index's key, not
    by reading every running sample of the instance (85-256 of them) to test `delivered`."""
    engine, run, inst = backlog
    if case not in _SENT:
        _SENT[case] = sent_by(engine, lambda: call(Protocol(engine), run, inst), marker)
    statement, parameters = _SENT[case]
    plan = plan_of(engine, statement, parameters, plan_mode)
    conds = [n.get("Index Cond", "") for n in nodes(plan) if n.get("Index Name") == index]
    assert conds and all("delivered" in c for c in conds), f"{statement}\n{describe(plan)}"


@PLAN_MODES
def test_route_candidates_use_queued_index(backlog, plan_mode):
    """How a coordinator or route worker takes the oldest queued samples of one run."""
    engine, run, _ = backlog
    plan = plan_of(
        engine,
        "SELECT id FROM samples WHERE run_id = %(run)s AND state = 'queued' ORDER BY id LIMIT 256 FOR UPDATE SKIP LOCKED",
        {"run": run},
        plan_mode,
    )
    assert plan["Node Type"] == "Limit" and "ix_samples_queued" in {n.get("Index Name") for n in nodes(plan)}, describe(
        plan
    )
    assert not any(n["Node Type"] == "Sort" for n in nodes(plan)), describe(plan)  # the index gives the order


# A young run, as the statistics then say: most of its samples in flight (30% queued, 60%
# running on 256 instances), 4,000 groups of 8, and a change log of a few minutes (5,000
# statements' sample changes, 200 of groups).
YOUNG_RUN_SQL = """
INSERT INTO runs (name, batch_size, buffer_capacity, group_size, samples_per_group, eta,
                  max_response_tokens, max_prompt_tokens, dapo_filter)
VALUES ('young', 64, 64, 8, 8, 2, 1024, 1024, false);

INSERT INTO instances (run_id, name, version, lease_expires_at)
SELECT r.id, 'inst-' || i, 0, now() + interval '1 hour' FROM runs r, generate_series(1, :instances) i;

INSERT INTO prompt_groups (run_id, client_key, prompt_tokens, state, reserved_buffer, min_version)
SELECT r.id, 'k' || g, ARRAY[1, 2, 3], 'reserved', 0, 0 FROM runs r, generate_series(1, :groups) g;

WITH inst AS (SELECT run_id, array_agg(id ORDER BY id) AS ids FROM instances GROUP BY run_id),
     s AS (SELECT g.run_id, g.id AS group_id, i AS idx, row_number() OVER (ORDER BY g.id, i) AS n
           FROM prompt_groups g, generate_series(0, 7) i)
INSERT INTO samples (run_id, group_id, idx, state, v_traj, attempt, instance_id, reward)
SELECT s.run_id, s.group_id, s.idx, st.state::sample_state, CASE WHEN st.state = 'queued' THEN NULL ELSE 0 END,
       CASE WHEN st.state = 'queued' THEN 0 ELSE 1 END,
       CASE WHEN st.state = 'running' THEN inst.ids[1 + s.n % cardinality(inst.ids)] END,
       CASE WHEN st.state = 'rewarded' THEN 1.0 END
FROM s JOIN inst USING (run_id),
LATERAL (SELECT CASE WHEN s.n % 10 < 3 THEN 'queued' WHEN s.n % 10 < 9 THEN 'running'
                     ELSE 'rewarded' END AS state) st;

INSERT INTO snapshot_changes (run_id, xid, sample_ids)
SELECT b.run_id, c, ARRAY(SELECT b.lo + (c * 30 + k) % (8 * :groups) FROM generate_series(0, 29) k)
FROM (SELECT run_id, min(id) AS lo FROM samples GROUP BY run_id) b, generate_series(1, 5000) c;

INSERT INTO snapshot_changes (run_id, xid, group_ids)
SELECT b.run_id, c, ARRAY(SELECT b.lo + (c * 8 + k) % :groups FROM generate_series(0, 7) k)
FROM (SELECT run_id, min(id) AS lo FROM prompt_groups GROUP BY run_id) b, generate_series(1, 200) c
"""


@pytest.fixture(scope="module")
def young_run(admin_url: str, template_db: str):
    """(engine, run) on a database holding one young run (YOUNG_RUN_SQL), dropped afterwards."""
    with database_of(admin_url, template_db, YOUNG_RUN_SQL, {"instances": 256, "groups": 4000}) as engine:
        with engine.connect() as conn:
            run = conn.execute(text("SELECT id FROM runs")).scalar()
        yield engine, run


@PLAN_MODES
def test_a_change_read_finds_what_changed_by_index(young_run, plan_mode):
    """The coordinator's change read (`snapshot_changes`) looks a changed group's members up by
    the unique (group_id, idx) index and the changed samples' groups by primary key: its cost
    follows what changed. Its generic plan also serves a whole read, and with a young run's
    statistics it hashed the changed samples against a scan of every group of the server."""
    engine, run = young_run
    protocol = Protocol(engine)
    since = protocol.snapshot_changes(run)[0]
    with engine.begin() as conn:  # a group change: the groups' trigger records it
        conn.execute(
            text(
                "UPDATE prompt_groups SET min_version = min_version + 1"
                " WHERE id = (SELECT min(id) FROM prompt_groups WHERE run_id = :r)"
            ),
            {"r": run},
        )
    statement, parameters = sent_by(engine, lambda: protocol.snapshot_changes(run, since), "unnest(x.group_ids)")
    plan = plan_of(engine, statement, parameters, plan_mode)
    scanned = {n.get("Relation Name") for n in nodes(plan) if n["Node Type"] == "Seq Scan"}
    used = {n.get("Index Name") for n in nodes(plan)}
    assert "prompt_groups" not in scanned and "uq_samples_group_id_idx" in used, f"{statement}\n{describe(plan)}"
