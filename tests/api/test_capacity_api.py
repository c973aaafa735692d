"""An engine's capacity over REST: registration stores it for the first cycle, a heartbeat may
replace it and one without it keeps it; a capacity below one is a 422 naming the field that
changes nothing."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from api.auth import create_token
from staleflow_db.protocol import Protocol
from staleflow_db.types import RunConfig
from tests.api.test_api_errors import expect, fingerprint
from tests.api_helpers import in_process


@pytest.fixture
def api(db_url, engine):
    run = Protocol(engine).create_run("cap", RunConfig(batch_size=1, group_size=1, eta=0))
    with in_process(db_url) as http:
        http.headers["Authorization"] = f"Bearer {create_token(engine, 'admin')['token']}"
        yield http, run, engine


def _capacity(engine, inst: int) -> dict | None:
    with engine.connect() as c:
        return c.execute(text("SELECT snapshot -> 'capacity' FROM instances WHERE id = :i"), {"i": inst}).scalar_one()


def test_registration_and_heartbeats_carry_the_capacity(api):
    http, run, engine = api
    cap = {"max_running": 4, "kv_capacity": 2_048}
    r = http.post(f"/v1/runs/{run}/instances", json={"name": "gpu0", "version": 0, "capacity": cap})
    assert r.status_code == 201, r.text
    inst = r.json()["instance_id"]
    assert _capacity(engine, inst) == cap  # before any heartbeat: the first cycle knows
    beat = f"/v1/runs/{run}/instances/{inst}/heartbeat"
    assert http.post(beat, json={"version": 0, "snapshot": {"running": 1}}).status_code == 200
    assert _capacity(engine, inst) == cap  # a snapshot without one keeps it
    new = {"max_running": 2, "kv_capacity": 1_024}
    assert http.post(beat, json={"version": 0, "snapshot": {"capacity": new}}).status_code == 200
    assert _capacity(engine, inst) == new
    r = http.post(f"/v1/runs/{run}/instances", json={"name": "gpu1", "version": 0})
    assert r.status_code == 201 and _capacity(engine, r.json()["instance_id"]) is None  # unreported


@pytest.mark.parametrize("field", ["max_running", "kv_capacity"])
@pytest.mark.parametrize("value", [0, -3])
def test_a_capacity_below_one_is_a_422_naming_the_field(api, field, value):
    http, run, engine = api
    inst = http.post(f"/v1/runs/{run}/instances", json={"name": "gpu0", "version": 0}).json()["instance_id"]
    before = fingerprint(engine)
    cap = {"max_running": 4, "kv_capacity": 2_048, field: value}
    err = expect(http.post(f"/v1/runs/{run}/instances", json={"name": "x", "version": 0, "capacity": cap}), 422)
    assert f"capacity.{field}" in err["message"], err
    beat = {"version": 0, "snapshot": {"capacity": cap}}
    err = expect(http.post(f"/v1/runs/{run}/instances/{inst}/heartbeat", json=beat), 422)
    assert f"snapshot.capacity.{field}" in err["message"], err
    assert fingerprint(engine) == before
