"""Runs over the real API (a `staleflow serve` process, real HTTP): created with their sampling
parameters, named by id or name in every path and client method, and their lifecycle --
paused runs route nothing and answer 409 to routes while in-flight work finishes and trains;
cancelled runs abort their unfinished work with the reason `run_cancelled` and refuse
enqueue, routing, registering and consume with 409 naming the state; the audit stays green."""

from __future__ import annotations

import httpx
import pytest
from api_helpers import ApiServer, token, walk_lifecycle
from sqlalchemy import text

from staleflow_db.audit import violations
from workers.client import Conflict, Forbidden, InvalidInput, NotFound, StaleFlowClient, Unauthorized


def _roles(db_url: str, api: ApiServer, run: int) -> dict[str, StaleFlowClient]:
    return {r: api.client(token(db_url, r, run)) for r in ("rollout", "reward", "trainer", "coordinator")}


def test_names_and_sampling_parameters(db_url, engine):
    with ApiServer(db_url) as api:
        admin = api.client(token(db_url, "admin"))
        run = admin.create_run("my run", batch_size=1, group_size=2, eta=1, temperature=0.7, top_p=0.9)
        assert (run.config.temperature, run.config.top_p, run.state.value) == (0.7, 0.9, "active")
        for bad, why in (("123", "all digits"), ("a/b", "'/'")):
            with pytest.raises(InvalidInput, match=why):
                admin.create_run(bad, batch_size=1, group_size=1, eta=0)
        cold = {"name": "cold", "config": {"batch_size": 1, "group_size": 1, "eta": 0, "temperature": 0}}
        r = httpx.post(f"{api.url}/v1/runs", json=cold, headers={"Authorization": f"Bearer {admin.token}"})
        assert r.status_code == 422 and "temperature" in r.text, r.text
        # every path takes the name (quoted by the client) or the id, resolved to the same run
        by_name, by_id = admin.run_status("my run"), admin.run_status(run.id)
        assert by_name == by_id and (by_name.run_id, by_name.name) == (run.id, "my run")
        assert by_name.config.temperature == 0.7
        with pytest.raises(NotFound, match="'nope'"):
            admin.run_status("nope")
        roles = _roles(db_url, api, run.id)
        assert roles["trainer"].enqueue("my run", [("k", [1, 2])]) == roles["trainer"].enqueue(run.id, [("k", [1, 2])])
        assert admin.param_versions("my run") == admin.param_versions(run.id) == []
        # a run-scoped token may not name another run, by name either
        other = admin.create_run("other", batch_size=1, group_size=1, eta=0)
        for name in ("other", "no such run"):  # 403 whether it exists or not: it learns nothing
            with pytest.raises(Forbidden, match=f"limited to run {run.id}"):
                roles["trainer"].run_status(name)
        with pytest.raises(Unauthorized):
            api.client("sf_not_a_token").run_status("no such run")
        assert other.id != run.id
    with engine.connect() as c:
        assert c.execute(text("SELECT temperature, top_p FROM runs WHERE name = 'my run'")).one() == (0.7, 0.9)


def test_pause_routes_nothing_and_resume_undoes_it(db_url, engine):
    with ApiServer(db_url) as api:
        admin = api.client(token(db_url, "admin"))
        run = admin.create_run("pausable", batch_size=1, group_size=2, eta=1).id
        roles = _roles(db_url, api, run)
        with pytest.raises(Forbidden, match="admin"):
            roles["trainer"].set_run_state(run, "pause")
        out = admin.set_run_state("pausable", "pause", "maintenance")
        assert (out.run.state.value, out.run.state_reason, out.aborted_groups) == ("paused", "maintenance", 0)
        assert admin.set_run_state(run, "pause").run.state.value == "paused"  # again: a no-op
        roles["trainer"].enqueue(run, [("p", [1, 2, 3])])  # enqueue goes on while paused
        inst = roles["rollout"].register(run, "gpu0", 0).instance_id
        queued = [q.sample_id for q in roles["coordinator"].snapshot(run).queued]
        with pytest.raises(Conflict, match="is paused: routing refused") as refused:
            roles["coordinator"].route(run, [(s, inst) for s in queued])
        assert refused.value.code == "run_not_active"
        assert admin.run_status(run).samples == {"queued": 2}  # nothing moved
        assert admin.set_run_state(run, "resume").run.state.value == "active"
        assert admin.run_status(run).state_reason is None
    with engine.connect() as c:
        kinds = c.execute(text("SELECT kind FROM events WHERE kind LIKE 'run_%' ORDER BY id")).scalars().all()
    assert kinds == ["run_created", "run_paused", "run_resumed"]


def test_paused_run_finishes_and_trains_in_flight_work(db_url, engine):
    """A pause after the last route: the routed work is reported, scored, consumed and
    published. (An interrupted sample is back in the queue, not in flight: it waits.)"""
    with ApiServer(db_url) as api:
        admin = api.client(token(db_url, "admin"))
        run = admin.create_run("drain", batch_size=1, group_size=2, eta=1).id
        roles = _roles(db_url, api, run)
        coord = roles["coordinator"]
        real_route, routes = coord.route, []

        def route_then_pause(r, pairs, epoch=None):
            out = real_route(r, pairs, epoch)
            routes.append(pairs)
            if len(routes) == 2:  # walk_lifecycle routes, interrupts one, routes it again
                admin.set_run_state(run, "pause")
            return out

        coord.route = route_then_pause  # type: ignore[method-assign]
        walk_lifecycle(admin, roles, run)
        status = admin.run_status(run)
        assert (status.state.value, status.version) == ("paused", 1)
    assert violations(engine, run) == []


def test_cancel_aborts_unfinished_work_and_refuses_with_409(db_url, engine):
    with ApiServer(db_url) as api:
        admin = api.client(token(db_url, "admin"))
        run = admin.create_run("doomed", batch_size=1, group_size=2, eta=1).id
        roles = _roles(db_url, api, run)
        rollout, coord, trainer = roles["rollout"], roles["coordinator"], roles["trainer"]
        trainer.enqueue(run, [("a", [1, 2]), ("b", [3, 4])])
        inst = rollout.register(run, "gpu0", 0).instance_id
        first = [q.sample_id for q in coord.snapshot(run).queued][:2]
        coord.route(run, [(s, inst) for s in first])  # group a running, group b queued
        assert len(rollout.poll(run, inst, wait=5).work) == 2

        out = admin.set_run_state("doomed", "cancel", "wrong data set")
        assert (out.run.state.value, out.run.state_reason, out.aborted_groups) == ("cancelled", "wrong data set", 2)
        # the instance is told to abort what it was running
        commands = rollout.poll(run, inst, wait=5).commands
        assert sorted((c.kind, c.sample_id) for c in commands) == [("abort", s) for s in sorted(first)]
        refusals = {
            "enqueue": lambda: trainer.enqueue(run, [("c", [5])]),
            "routing": lambda: coord.route(run, [(first[0], inst)]),
            "registering an instance": lambda: rollout.register(run, "gpu1", 0),
            "consume": lambda: trainer.consume(run, 0, wait=0),
            "become active": lambda: admin.set_run_state(run, "resume"),
        }
        for doing, call in refusals.items():
            with pytest.raises(Conflict, match=f"is cancelled: (it cannot )?{doing}") as refused:
                call()
            assert refused.value.code == "run_not_active", doing
        assert admin.set_run_state(run, "cancel").aborted_groups == 0  # again: a no-op
        assert admin.run_status(run).samples == {"aborted": 4}
        dropped = admin.dropped_samples(run)
        assert len(dropped) == 4 and {d.reason for d in dropped} == {"run_cancelled"}
    assert violations(engine, run) == []
