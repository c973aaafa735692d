"""Responses serialised straight from the data layer's dataclasses (api.service.dump, no model
per item) are exactly the JSON their response model gives: same fields in the same order, no
field the model lacks (a route's secret lease token), and the same bytes on an idempotent replay."""

from __future__ import annotations

import uuid

import pytest

from api.models import ClusterSnapshotOut, RouteOut
from tests.api_helpers import in_process, token
from workers.client import StaleFlowClient

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
        admin.heartbeat(run, inst, 0, {"running": 1, "waiting": 0, "kv_used": 3, "kv_capacity": 64})
        queued = [q.sample_id for q in admin.snapshot(run).queued]

        key = uuid.uuid4().hex
        routes = {"routes": [{"sample_id": s, "instance_id": inst} for s in queued[:3]]}
        first = admin.http.post(f"/v1/runs/{run}/routes", json=routes, headers={"Idempotency-Key": key})
        assert first.status_code == 200, first.text
        _canonical(RouteOut, first.content)
        assert b"lease" not in first.content
        assert [r["outcome"] for r in first.json()["results"]] == ["routed"] * 3
        replay = admin.http.post(f"/v1/runs/{run}/routes", json=routes, headers={"Idempotency-Key": key})
        assert replay.content == first.content
        again = admin.route(run, [(queued[0], inst)])  # refused: a result with nulls
        assert [(r.outcome, r.attempt) for r in again] == [("not_queued", None)]

        # A partial segment then an interrupt: a queued sample with tokens, a version and an instance.
        (work, *_) = admin.poll(run, inst, wait=0).work
        item = {"sample_id": work.sample_id, "attempt": work.attempt, "lease": work.lease, "version": 0}
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
