"""Every statement a protocol step sends through the API, planned on a large backlog: none may
read a whole large table, neither with the plan for its values (what PostgreSQL chooses while
that looks cheaper) nor with the generic plan a prepared statement gets without them
(`STALEFLOW_PLAN_CACHE_MODE=force_generic_plan`, or `auto` once a statement ran 5 times and its
generic plan looks no costlier).

The steps: one full lifecycle through the app in this process (tests/api_helpers.walk_lifecycle:
enqueue, register, heartbeat, snapshot, route, polls, partial, interrupted and finished
reports, claim, rewards, consume, publish, deregister) and a node's syncs (deliveries, reports
with snapshots and a heartbeat) with the coordinator's snapshot changes, recorded as test_plans records them,
on test_plans' backlog database (4 runs x 18k samples, ANALYZEd). A statement without
parameters has one plan; one that reads only small tables (instances, runs, ...) may scan them.

The same statements are planned again on a young run's statistics (a server that hosted other
runs: its live instances and running samples few), where a generic plan made then would find
rows named by id through the partial indexes of the rows in flight: none may.
"""

from __future__ import annotations

import re

import pytest
from api_helpers import ROLES, TestClient, in_process, segment, walk_lifecycle
from sqlalchemy import Engine, text
from statement_recorder import recording

from api.auth import create_token
from tests.db.test_plans import PLAN_MODES, backlog, database_of, describe, nodes, plan_of  # noqa: F401 (backlog: the fixture)
from workers.client import StaleFlowClient

LARGE_ROWS = 5_000  # a table with more rows than this is large
# Statements that read all of one run's rows by design, which on this backlog (a run is a
# quarter of each table) is best done by reading the table: (a substring, the named query).
RUN_WIDE = [
    ("SELECT state::text, count(*) FROM samples WHERE run_id", "status_samples: a run's counts by state"),
    ("SELECT state::text, count(*) FROM prompt_groups WHERE run_id", "status_groups: a run's groups by state"),
]


def node_round(admin: StaleFlowClient, client) -> None:
    """A node of three instances: one sync delivers their work, one reports partials with
    snapshots and a heartbeat, one finishes them; the coordinator reads what changed."""
    run = admin.create_run("plans-node", batch_size=3, group_size=1, eta=0, max_response_tokens=100).id
    admin.enqueue(run, [(f"n{i}", [1, 2, 3 + i]) for i in range(3)])
    rollout, coordinator = client("rollout", run), client("coordinator", run)
    iids = [rollout.register(run, f"node-{k}", 0).instance_id for k in range(3)]
    coordinator.http.get(f"/v1/runs/{run}/snapshot/changes").raise_for_status()
    queued = [q.sample_id for q in coordinator.snapshot(run).queued]
    coordinator.route(run, list(zip(queued, iids, strict=True)))
    works = {d.instance_id: d.work[0] for d in rollout.sync(run, poll=iids, wait=0).deliveries}

    def report(kind: str) -> list[dict]:
        return [
            {
                "instance_id": i,
                "reports": [segment(w, [5, 6], [-0.1, -0.2], kind)],
                "snapshot": {"running": 1},
                **({"heartbeat": {"version": 0}} if i == iids[0] else {}),
            }
            for i, w in works.items()
        ]

    for kind in ("partial", "finished"):
        out = rollout.sync(run, report(kind), poll=iids, wait=0)
        assert [r.status for r in out.results] == [200, 200, 200], out.results
    coordinator.http.get(f"/v1/runs/{run}/snapshot/changes").raise_for_status()


@pytest.fixture(scope="module")
def sent(backlog):  # noqa: F811 (the fixture)
    """Each distinct (statement, parameters) one lifecycle sent, in order."""
    engine, _, _ = backlog
    url = engine.url.render_as_string(hide_password=False)
    recorded: dict[str, object] = {}

    def record(conn, statement, parameters):
        if not isinstance(parameters, list):  # an executemany's: not one statement's values
            recorded.setdefault(statement, parameters)

    with in_process(url) as http:

        def client(role: str, run_id: int | None = None) -> StaleFlowClient:
            # a client of its own per role (the client sets its token on the httpx client's
            # headers); the first one's lifespan started the app they share
            own = TestClient(http.app, raise_server_exceptions=False)
            return StaleFlowClient(token=create_token(engine, role, run_id)["token"], http=own)

        admin = client("admin")
        run = admin.create_run("plans-walk", batch_size=2, group_size=2, eta=1, samples_per_group=2)
        roles = {r: client(r, run.id) for r in ROLES}
        with recording(Engine, record):
            walk_lifecycle(admin, roles, run.id)
            node_round(admin, client)
    large = large_tables(engine)
    assert {"samples", "prompt_groups"} <= large, large
    return engine, [(s, p) for s, p in recorded.items() if p], large


def large_tables(engine) -> set[str]:
    with engine.connect() as conn:
        query = text("SELECT relname FROM pg_class WHERE relkind IN ('r', 'p') AND reltuples > :n")
        return set(conn.execute(query, {"n": LARGE_ROWS}).scalars())


@PLAN_MODES
def test_no_statement_reads_a_whole_large_table(sent, plan_mode):
    engine, statements, large = sent
    assert len(statements) >= 50, [s for s, _ in statements]
    scans = []
    for statement, parameters in statements:
        if any(marker in statement for marker, _ in RUN_WIDE):
            continue
        plan = plan_of(engine, statement, parameters, plan_mode)
        whole = sorted({n.get("Relation Name") for n in nodes(plan) if n["Node Type"] == "Seq Scan"} & large)
        if whole:
            scans.append(f"{whole}: {statement}\n{describe(plan)}")
    assert not scans, f"{len(scans)} statements read a whole large table:\n\n" + "\n\n".join(scans)


# Statistics as a run starts on a server that hosted others: most instances deregistered, most
# samples queued or finished, a handful running. The partial indexes of the live rows (on state:
# ix_instances_active, ix_samples_running) then look nearly empty, and a generic plan made now
# is kept by every pooled connection until the next ANALYZE, while the run grows to hundreds of
# instances and tens of thousands of running samples. Reading such an index whole, or by run and
# filtering by id, then costs each call the size of the run.
YOUNG_SQL = """
INSERT INTO runs (name, batch_size, buffer_capacity, group_size, samples_per_group, eta,
                  max_response_tokens, max_prompt_tokens, dapo_filter)
SELECT 'young-' || r, 64, 64, 4, 4, 2, 1024, 1024, false FROM generate_series(1, :runs) r;

INSERT INTO instances (run_id, name, version, lease_expires_at, state)
SELECT r.id, 'inst-' || i, 0, now() + interval '1 hour',
       CASE WHEN r.id = (SELECT max(id) FROM runs) AND i <= 4 THEN 'active' ELSE 'deregistered' END::instance_state
FROM runs r, generate_series(1, :instances) i;

INSERT INTO prompt_groups (run_id, client_key, prompt_tokens, state, reserved_buffer, min_version)
SELECT r.id, 'k' || g, ARRAY[1, 2, 3], 'reserved', 0, 0 FROM runs r, generate_series(1, :groups) g;

WITH inst AS (SELECT array_agg(id ORDER BY id) AS ids FROM instances WHERE state = 'active'),
     s AS (SELECT g.run_id, g.id AS group_id, i AS idx, row_number() OVER (ORDER BY g.id, i) AS n
           FROM prompt_groups g, generate_series(0, :per_group - 1) i)
INSERT INTO samples (run_id, group_id, idx, state, v_traj, attempt, instance_id, delivered)
SELECT s.run_id, s.group_id, s.idx, st.state::sample_state, CASE WHEN st.state = 'queued' THEN NULL ELSE 0 END,
       CASE WHEN st.state = 'queued' THEN 0 ELSE 1 END,
       CASE WHEN st.state = 'running' THEN inst.ids[1 + s.n % cardinality(inst.ids)] END, st.state = 'running'
FROM s, inst, LATERAL (SELECT CASE WHEN s.n % 2000 = 0 THEN 'running' WHEN s.n % 2 = 0 THEN 'queued'
                                   ELSE 'finished' END AS state) st;
"""
# the partial indexes of rows in flight, which a run's size fills
IN_FLIGHT = {"ix_instances_active", "ix_samples_running"}
# Statements that may read an in-flight index whole: (a substring, why)
IN_FLIGHT_WHOLE = [
    (
        "WITH p AS MATERIALIZED (SELECT CASE WHEN length(CAST(pg_current_snapshot()",
        "snapshot_changes: a whole read (a coordinator's first) takes every running sample of the run",
    )
]


@pytest.fixture(scope="module")
def young(admin_url: str, template_db: str):
    params = {"runs": 3, "instances": 2_000, "groups": 3_000, "per_group": 4}
    with database_of(admin_url, template_db, YOUNG_SQL, params) as engine:
        yield engine


def _reads_by_state(node: dict) -> bool:
    """A scan of an in-flight index that is not its lookup: the whole index (no condition), or
    the run's entries filtered by id (the primary key's lookup done the long way)."""
    if node.get("Index Name") not in IN_FLIGHT:
        return False
    return not node.get("Index Cond") or re.search(r"\bid = ", node.get("Filter", "")) is not None


@PLAN_MODES
def test_lookups_by_id_take_the_primary_key_whatever_the_statistics(sent, young, plan_mode):
    """Every statement planned on a young run's statistics: none reads an in-flight partial
    index whole or by run to find rows it names by id, none intersects two indexes of a table
    (BitmapAnd: the in-flight index's bitmap built whole), and none reads a whole large table
    (here `instances` too: a server that hosted many runs)."""
    _, statements, _ = sent
    large = large_tables(young)
    assert {"instances", "samples"} <= large, large
    found = []
    for statement, parameters in statements:
        if any(marker in statement for marker, _ in RUN_WIDE):
            continue
        plan = plan_of(young, statement, parameters, plan_mode)
        whole_ok = any(marker in statement for marker, _ in IN_FLIGHT_WHOLE)
        bad = [
            f"{n['Node Type']} {n.get('Relation Name', '')} {n.get('Index Name', '')}".strip()
            for n in nodes(plan)
            if n["Node Type"] == "BitmapAnd"
            or (_reads_by_state(n) and not whole_ok)
            or (n["Node Type"] == "Seq Scan" and n.get("Relation Name") in large)
        ]
        if bad:
            found.append(f"{bad}: {statement}\n{describe(plan)}")
    assert not found, f"{len(found)} statements depend on the statistics to find their rows:\n\n" + "\n\n".join(found)
