"""An instance belongs to the API token that registered it: over real HTTP, another rollout
token of the same run may not poll, heartbeat, report for or deregister it (403, nothing
changes); the registering token and an admin token of the run may."""

from __future__ import annotations

import pytest

from api.auth import create_token
from staleflow_db.payloads import unpack_tokens
from tests.api_helpers import ApiServer
from tests.protocol_helpers import Driver
from workers.client import Forbidden

pytestmark = pytest.mark.db


def _instance(d: Driver, inst: int):
    return d.one("SELECT state::text, lease_expires_at, snapshot, token_id FROM instances WHERE id = :i", i=inst)


def _segments(d: Driver) -> list:
    rows = d.rows("SELECT sample_id, instance_id, attempt, token_ids FROM segments WHERE run_id = :r ORDER BY 1, seq")
    return [(*r[:3], unpack_tokens(r[3])) for r in rows]


def _refused(call) -> None:
    with pytest.raises(Forbidden) as refused:
        call()
    assert refused.value.status == 403 and refused.value.code == "forbidden"
    assert "belongs to another token" in refused.value.message


def test_another_rollout_token_gets_403_and_changes_nothing(db_url, engine):
    d = Driver(engine, batch_size=1, group_size=1, eta=0)
    (g,) = d.enqueue(1)
    (s,) = d.members(g)
    owner_row = create_token(engine, "rollout", d.run)
    other_token = create_token(engine, "rollout", d.run)["token"]
    with ApiServer(db_url) as server:
        coord = server.client(create_token(engine, "coordinator", d.run)["token"])
        owner, other = server.client(owner_row["token"]), server.client(other_token)
        inst = owner.register(d.run, "a", 0).instance_id
        assert _instance(d, inst)[3] == owner_row["id"]
        assert [r.outcome for r in coord.route(d.run, [(s, inst)])] == ["routed"]
        before = _instance(d, inst)

        # Polling another's path would hand over its routed work and route token.
        _refused(lambda: other.poll(d.run, inst, wait=0))
        assert d.one("SELECT delivered FROM samples WHERE id = :s", s=s) == (False,)
        _refused(
            lambda: other.heartbeat(
                d.run, inst, 0, {"kv_used": 5, "capacity": {"max_running": 1, "kv_capacity": 10}}, lease_seconds=600
            )
        )
        assert _instance(d, inst) == before  # lease not extended, snapshot unchanged

        (work,) = owner.poll(d.run, inst, wait=5).work  # the work is still the owner's to take
        item = {
            "sample_id": s,
            "attempt": work.attempt,
            "route_token": work.route_token,
            "version": 0,
            "tokens": [7],
            "logprobs": [-0.7],
        }
        _refused(lambda: other.report(d.run, inst, [item]))  # even quoting the right route token
        assert _segments(d) == [] and d.sample(s)[0] == "running"
        _refused(lambda: other.deregister(d.run, inst))
        assert _instance(d, inst)[0] == "active" and d.sample(s)[0] == "running" and d.sample(s)[5] == inst

        owner.heartbeat(d.run, inst, 0)
        assert owner.report(d.run, inst, [item]) == 1
        assert _segments(d) == [(s, inst, work.attempt, [7])]
        assert owner.deregister(d.run, inst) == []  # the sample finished with that report
        assert _instance(d, inst)[0] != "active"


def test_an_admin_of_the_run_may_act_for_any_instance(db_url, engine):
    d = Driver(engine, batch_size=1, group_size=1, eta=0)
    (g,) = d.enqueue(1)
    (s,) = d.members(g)
    with ApiServer(db_url) as server:
        coord = server.client(create_token(engine, "coordinator", d.run)["token"])
        owner = server.client(create_token(engine, "rollout", d.run)["token"])
        admin = server.client(create_token(engine, "admin", d.run)["token"])
        inst = owner.register(d.run, "a", 0).instance_id
        coord.route(d.run, [(s, inst)])
        (work,) = admin.poll(d.run, inst, wait=5).work
        admin.heartbeat(d.run, inst, 0)
        item = {
            "sample_id": s,
            "attempt": work.attempt,
            "route_token": work.route_token,
            "version": 0,
            "tokens": [3],
            "logprobs": [-0.3],
        }
        assert admin.report(d.run, inst, [item]) == 1
        assert _segments(d) == [(s, inst, work.attempt, [3])]
        assert admin.deregister(d.run, inst) == []  # the sample finished with that report


def test_one_registration_key_is_never_shared_between_tokens(db_url, engine):
    """The same Idempotency-Key from two tokens registers two instances: a replay must not hand
    one token the instance of another."""
    d = Driver(engine, batch_size=1, group_size=1, eta=0)
    a, b = (create_token(engine, "rollout", d.run) for _ in range(2))
    with ApiServer(db_url) as server:
        body, key = {"name": "w", "version": 0}, {"Idempotency-Key": "same-key"}
        ids = []
        for row in (a, a, b):
            r = server.client(row["token"]).http.post(f"/v1/runs/{d.run}/instances", json=body, headers=key)
            assert r.status_code == 201, r.text
            ids.append(r.json()["instance_id"])
    assert ids[0] == ids[1] != ids[2]  # a's retry replays; b gets its own
    assert [_instance(d, i)[3] for i in ids] == [a["id"], a["id"], b["id"]]


def test_an_instance_registered_without_a_token_is_an_admins_alone(db_url, engine):
    d = Driver(engine, batch_size=1, group_size=1, eta=0)
    inst = d.p.register_instance(d.run, "in-process", 0)
    assert _instance(d, inst)[3] is None
    with ApiServer(db_url) as server:
        _refused(lambda: server.client(create_token(engine, "rollout", d.run)["token"]).heartbeat(d.run, inst, 0))
        server.client(create_token(engine, "admin", d.run)["token"]).heartbeat(d.run, inst, 0)
