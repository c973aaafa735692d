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
"""

from __future__ import annotations

import pytest
from api_helpers import ROLES, TestClient, in_process, segment, walk_lifecycle
from sqlalchemy import Engine, text
from statement_recorder import recording

from api.auth import create_token
from tests.db.test_plans import PLAN_MODES, backlog, describe, nodes, plan_of  # noqa: F401 (backlog: the fixture)
from workers.client import StaleFlowClient

LARGE_ROWS = 5_000  # a table with more rows than this is large
# Statements that read all of one run's rows by design, which on this backlog (a run is a
# quarter of each table) is best done by reading the table: (a substring, the named query).
RUN_WIDE = [("SELECT state::text, count(*) FROM samples WHERE run_id", "status_samples: a run's counts by state")]


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
    with engine.connect() as conn:
        large = set(
            conn.execute(
                text("SELECT relname FROM pg_class WHERE relkind IN ('r', 'p') AND reltuples > :n"), {"n": LARGE_ROWS}
            ).scalars()
        )
    assert {"samples", "prompt_groups"} <= large, large
    return engine, [(s, p) for s, p in recorded.items() if p], large


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
