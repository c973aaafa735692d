"""Responses serialised straight from the data layer's dataclasses (api.service.dump, no model
per item: snapshot, route, poll, node poll, claim, consume) are exactly the JSON their response model
gives: same fields in the same order, no field the model lacks (a route's secret route token),
and the same bytes on an idempotent replay."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import text

from api.routers.node import _answered, _delivered, _polled
from staleflow_db.db import make_engine
from staleflow_db.protocol import NodeDelivery
from staleflow_db.protocol.rollout import Command, Poll, Work
from tests.api_helpers import in_process, token
from workers.client import StaleFlowClient
from workers.wire.models import ClaimOut, ClusterSnapshotOut, ConsumeOut, NodeSyncOut, PollOut, RouteOut
from workers.wire.packed import PACKED_CONTEXT, pack_int32

pytestmark = pytest.mark.db


def _canonical(model, raw: bytes) -> None:
    assert model.model_validate_json(raw).model_dump_json().encode() == raw


# A value the adapter does not expect is a serializer warning: here a failure (a 500).
@pytest.mark.filterwarnings("error:Pydantic serializer:UserWarning")
def test_snapshot_and_route_bodies_are_the_models_json(db_url):
    with in_process(db_url) as http:
        admin = StaleFlowClient(http=http, token=token(db_url, "admin"), retry_for=None)
        run = admin.create_run("ser", batch_size=2, group_size=2, eta=1).id
        admin.enqueue(run, [(f"p{i}", [1, 2, 3 + i]) for i in range(3)])
        inst = admin.register(run, "gpu0", 0).instance_id
        admin.heartbeat(
            run, inst, 0, {"running": 1, "waiting": 0, "kv_used": 3, "capacity": {"max_running": 4, "kv_capacity": 64}}
        )
        queued = [q.sample_id for q in admin.snapshot(run).queued]

        key = uuid.uuid4().hex
        routes = {"routes": [{"sample_id": s, "instance_id": inst} for s in queued[:3]]}
        first = admin.http.post(f"/v1/runs/{run}/routes", json=routes, headers={"Idempotency-Key": key})
        assert first.status_code == 200, first.text
        _canonical(RouteOut, first.content)
        assert b"route_token" not in first.content
        assert [r["outcome"] for r in first.json()["results"]] == ["routed"] * 3
        replay = admin.http.post(f"/v1/runs/{run}/routes", json=routes, headers={"Idempotency-Key": key})
        assert replay.content == first.content
        again = admin.route(run, [(queued[0], inst)])  # refused: a result with nulls
        assert [(r.outcome, r.attempt) for r in again] == [("not_queued", None)]

        # A partial segment then an interrupt: a queued sample with tokens, a version and an instance.
        (work, *_) = admin.poll(run, inst, wait=0).work
        item = {"sample_id": work.sample_id, "attempt": work.attempt, "route_token": work.route_token, "version": 0}
        admin.report(run, inst, [{**item, "tokens": [7, 8], "logprobs": [-0.5, -0.25], "kind": "partial"}])
        admin.interrupt(run, [work.sample_id])
        admin.report(run, inst, [{**item, "tokens": [9], "logprobs": [-1.0], "kind": "interrupted"}])

        raw = admin.http.get(f"/v1/runs/{run}/snapshot")
        assert raw.status_code == 200, raw.text
        _canonical(ClusterSnapshotOut, raw.content)
        snap = ClusterSnapshotOut.model_validate_json(raw.content)
        (resumed,) = [q for q in snap.queued if q.sample_id == work.sample_id]
        assert (resumed.tokens, resumed.last_version, resumed.last_instance) == (3, 0, inst)
        assert resumed.length == 3 + 3 and resumed.group_state == "reserved"
        (live,) = snap.instances
        assert live.instance_id == inst and live.snapshot["kv_used"] == 3
        assert {r.sample_id for r in live.running} == set(queued[:3]) - {work.sample_id}
        assert len(snap.queued) == 6 - 2 and snap.buffers and snap.latest_params is None


@pytest.mark.filterwarnings("error:Pydantic serializer:UserWarning")
def test_poll_claim_and_consume_bodies_are_the_models_json(db_url):
    with in_process(db_url) as http:
        admin = StaleFlowClient(http=http, token=token(db_url, "admin"), retry_for=None)
        run = admin.create_run("ser", batch_size=1, group_size=2, eta=0).id
        admin.enqueue(run, [("p", [5, 6, 7])])
        inst = admin.register(run, "gpu0", 0).instance_id
        base = f"/v1/runs/{run}"

        def post(path: str, model, **kw):
            r = admin.http.post(base + path, **kw)
            assert r.status_code == 200, r.text
            _canonical(model, r.content)
            return r

        assert post(f"/instances/{inst}/poll?wait=0", PollOut).json() == {"work": [], "commands": []}
        assert post("/batches/0/consume?wait=0", ConsumeOut).json() == {"ready": False, "version": 0, "batch": None}
        assert post("/rewards/claim?wait=0", ClaimOut, json={}).json() == {"tasks": []}

        samples = [q.sample_id for q in admin.snapshot(run).queued]
        admin.route(run, [(s, inst) for s in samples])
        key = {"Idempotency-Key": uuid.uuid4().hex}
        polled = post(f"/instances/{inst}/poll?wait=0", PollOut, headers=key)
        assert post(f"/instances/{inst}/poll?wait=0", PollOut, headers=key).content == polled.content  # replay
        work = polled.json()["work"]
        assert sorted(w["sample_id"] for w in work) == sorted(samples) and work[0]["prompt_tokens"] == [5, 6, 7]
        admin.interrupt(run, [samples[0]])
        (command,) = post(f"/instances/{inst}/poll?wait=0", PollOut).json()["commands"]
        assert command["kind"] == "interrupt" and command["sample_id"] == samples[0]

        reports = [
            {"sample_id": w["sample_id"], "attempt": w["attempt"], "route_token": w["route_token"], "version": 0}
            | {"tokens": [9, 10], "logprobs": [-0.5, -0.25], "finish_reason": "stop"}
            for w in work
        ]
        admin.report(run, inst, reports)
        # one task as lists, the other packed; a replay answers in the form it is asked for
        claimed = post("/rewards/claim?wait=0", ClaimOut, json={"limit": 1}, headers=key)
        assert post("/rewards/claim?wait=0", ClaimOut, json={"limit": 1}, headers=key).content == claimed.content
        (task,) = claimed.json()["tasks"]
        assert task["response_tokens"] == [9, 10] and task["finish_reason"] == "stop"

        def post_packed(headers: dict, limit: int = 10):
            r = admin.http.post(f"{base}/rewards/claim?wait=0&packed=true", json={"limit": limit}, headers=headers)
            assert r.status_code == 200, r.text
            assert ClaimOut.model_validate_json(r.content).model_dump_json(context=PACKED_CONTEXT).encode() == r.content
            return r

        other = {"Idempotency-Key": uuid.uuid4().hex}
        packed = post_packed(other)
        (packed_task,) = packed.json()["tasks"]
        assert packed_task["response_tokens"] == pack_int32([9, 10]) and packed_task["prompt_tokens"] == pack_int32(
            [5, 6, 7]
        )
        assert post_packed(other).content == packed.content
        assert post_packed(key, limit=1).json()["tasks"] == [
            task | {"prompt_tokens": packed_task["prompt_tokens"]} | {"response_tokens": packed_task["response_tokens"]}
        ]
        as_lists = post("/rewards/claim?wait=0", ClaimOut, json={"limit": 10}, headers=other).json()["tasks"]
        assert as_lists == [packed_task | {"prompt_tokens": [5, 6, 7], "response_tokens": [9, 10]}]
        tasks = [task, packed_task]
        admin.record_rewards(run, [(t["sample_id"], t["reward_attempt"], 1.0) for t in tasks])
        batch = post("/batches/0/consume?wait=0", ConsumeOut).json()["batch"]
        (group,) = batch["groups"]
        assert group["prompt_tokens"] == [5, 6, 7] and [s["logprobs"] for s in group["samples"]] == [[-0.5, -0.25]] * 2
        assert group["samples"][0]["segments"][0]["instance_id"] == inst


@pytest.mark.filterwarnings("error:Pydantic serializer:UserWarning")
def test_node_poll_bodies_are_the_models_json(db_url):
    """Nothing, work (replayed under its key), a command, a fenced instance beside a live one, and
    a poll with items: each the model's JSON, and a long-poll that returns at once exactly when
    something is delivered or an instance is fenced."""
    with in_process(db_url) as http:
        admin = StaleFlowClient(http=http, token=token(db_url, "admin"), retry_for=None)
        run = admin.create_run("ser-node", batch_size=2, group_size=2, eta=0).id
        admin.enqueue(run, [("p", [5, 6, 7]), ("q", [8])])
        a, b = (admin.register(run, f"gpu{k}", 0).instance_id for k in range(2))
        sync = f"/v1/runs/{run}/instances/sync"

        def post(body: dict, wait: float = 0, **kw) -> dict:
            r = admin.http.post(f"{sync}?wait={wait}", json=body, **kw)
            assert r.status_code == 200, r.text
            _canonical(NodeSyncOut, r.content)
            return r.json()

        nothing = {"instance_id": a, "status": 200, "work": [], "commands": [], "error": None}
        assert post({"poll": [a, b]}) == {"results": [], "deliveries": [nothing, nothing | {"instance_id": b}]}

        samples = [q.sample_id for q in admin.snapshot(run).queued]
        admin.route(run, [(samples[0], a), (samples[2], a)])
        key = {"Idempotency-Key": uuid.uuid4().hex}
        polled = admin.http.post(f"{sync}?wait=0", json={"poll": [a, b]}, headers=key)
        _canonical(NodeSyncOut, polled.content)
        assert admin.http.post(f"{sync}?wait=0", json={"poll": [a, b]}, headers=key).content == polled.content
        first, second = polled.json()["deliveries"]
        assert sorted(w["sample_id"] for w in first["work"]) == [samples[0], samples[2]] and not second["work"]
        assert {tuple(w["prompt_tokens"]) for w in first["work"]} == {(5, 6, 7), (8,)}

        admin.interrupt(run, [samples[0]])
        (command,) = post({"poll": [a, b]}, wait=30)["deliveries"][0]["commands"]  # at once: delivered
        assert command["kind"] == "interrupt" and command["sample_id"] == samples[0]

        engine = make_engine(db_url)
        try:
            with engine.begin() as c:
                c.execute(text("UPDATE instances SET lease_expires_at = now() WHERE id = :i"), {"i": b})
        finally:
            engine.dispose()
        live, fenced = post({"poll": [a, b]}, wait=30)["deliveries"]  # at once: an instance fenced
        assert live == nothing and fenced["status"] == 409 and fenced["error"]["code"]
        assert fenced["work"] == [] and fenced["commands"] == []

        work = first["work"][1]
        item = {"sample_id": work["sample_id"], "attempt": work["attempt"], "route_token": work["route_token"]}
        report = item | {"version": 0, "tokens": [9], "logprobs": [-0.5], "kind": "partial"}
        both = post({"items": [{"instance_id": a, "reports": [report]}], "poll": [a]})
        assert both == {
            "results": [{"instance_id": a, "status": 200, "applied": 1, "error": None}],
            "deliveries": [nothing],
        }


def test_a_node_polls_json_says_what_it_delivered():
    """The long-poll's and the store's tests read the serialised poll: nothing delivered waits and
    is not kept; work or a command returns and is kept; a fenced instance returns, not kept. A
    prompt's free `meta` (strings and keys that look like the markers) cannot fool them."""

    tricky = {"work": [{"x": 1}], "commands": [{}], "status": 409, "s": '"work":[{ "status":409'}
    work = Work(1, 1, "t", 1, 0, [5], [], [], 10, meta=tricky)
    command = Command(2, "interrupt", 1, 1, None)
    cases = {
        "nothing": ([NodeDelivery(7), NodeDelivery(8)], False, False),
        "work": ([NodeDelivery(7), NodeDelivery(8, Poll(work=[work]))], True, True),
        "command": ([NodeDelivery(7, Poll(commands=[command])), NodeDelivery(8)], True, True),
        "fenced": ([NodeDelivery(7), NodeDelivery(8, refused=[(8, "lapsed")], code="lease_lapsed")], True, False),
    }
    for name, (deliveries, answered, kept) in cases.items():
        raw = _polled(deliveries)
        _canonical(NodeSyncOut, raw)
        assert (_answered(raw), _delivered(raw)) == (answered, kept), name
    nothing = _polled([NodeDelivery(7)])
    assert not _answered(nothing) and b"status" in nothing and b'"work":[]' in nothing
