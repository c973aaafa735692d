"""Hand-written bad input: oversized payloads, stale attempts, publishing out of order, unknown
ids, malformed bodies, reused request ids. Each is a clear 4xx JSON error that changes nothing."""

from __future__ import annotations

import json
import uuid

import pytest
from sqlalchemy import text

from api.auth import create_token
from staleflow_db.protocol import Prompt, Protocol
from staleflow_db.types import RunConfig
from tests.api_helpers import in_process

TABLES = (
    "runs",
    "prompt_groups",
    "samples",
    "segments",
    "buffers",
    "commands",
    "events",
    "idempotency",
    "param_versions",
    "instances",
    "api_tokens",
)


def fingerprint(engine) -> dict[str, object]:
    """Every table's rows, hashed: equal before and after means nothing changed."""
    with engine.connect() as c:
        return {
            t: c.execute(
                text(f"SELECT md5(coalesce(string_agg(x::text, ',' ORDER BY x::text), '')) FROM {t} x")
            ).scalar()
            for t in TABLES
        }


@pytest.fixture
def world(db_url, engine):
    """A run with one routed, running sample (attempt known) and one instance, and an admin."""
    p = Protocol(engine)
    run = p.create_run("r", RunConfig(batch_size=1, group_size=1, eta=0, max_response_tokens=8, max_prompt_tokens=4))
    (group,) = p.enqueue(run, [Prompt("k", [1, 2])])
    inst = p.register_instance(run, "gpu0", 0)
    with engine.connect() as c:
        sample = c.execute(text("SELECT id FROM samples WHERE group_id = :g"), {"g": group}).scalar()
    (routed,) = p.route(run, [(sample, inst)])
    other_run = p.create_run("other", RunConfig(batch_size=1, group_size=1, eta=0))
    other_inst = p.register_instance(other_run, "gpu1", 0)
    admin = create_token(engine, "admin")["token"]
    with in_process(db_url, max_body_bytes=64 * 1024, max_wait=0.2) as http:
        http.headers["Authorization"] = f"Bearer {admin}"
        yield {
            "http": http,
            "run": run,
            "inst": inst,
            "sample": sample,
            "attempt": routed.attempt,
            "group": group,
            "route_token": routed.route_token,
            "other_inst": other_inst,
            "engine": engine,
        }


def report(w, **over):
    r = {
        "sample_id": w["sample"],
        "attempt": w["attempt"],
        "route_token": w["route_token"],
        "version": 0,
        "tokens": [5],
        "logprobs": [-0.1],
    }
    return {"reports": [{**r, **over}]}


def expect(response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and body["error"]["message"], body
    if code:
        assert body["error"]["code"] == code, body
    return body["error"]


def test_bad_input_is_a_clear_4xx_that_changes_nothing(world):
    http, run, inst, engine = world["http"], world["run"], world["inst"], world["engine"]
    before = fingerprint(engine)
    seg = f"/v1/runs/{run}/instances/{inst}/segments"

    # oversized: the whole body, the run's response limit, the run's prompt limit, the batch limit
    expect(
        http.post(seg, content=b"{" + b" " * 70_000 + b"}", headers={"Content-Type": "application/json"}),
        413,
        "too_large",
    )
    chunked = http.post(
        seg,
        content=iter([b'{"reports": [' + b" " * 40_000, b" " * 40_000 + b"]}"]),
        headers={"Content-Type": "application/json"},
    )
    expect(chunked, 413, "too_large")
    err = expect(http.post(seg, json=report(world, tokens=list(range(9)), logprobs=[0.0] * 9)), 413, "too_large")
    assert "8 tokens" in err["message"]
    expect(http.post(f"/v1/runs/{run}/prompts", json={"prompts": [{"client_key": "x", "prompt_tokens": [1] * 5}]}), 422)
    many = [{"sample_id": i + 1, "reward_attempt": 1, "reward": 0.0} for i in range(10_001)]
    expect(http.post(f"/v1/runs/{run}/rewards", json={"rewards": many}), 413, "too_large")

    # stale attempts and lost claims: 409 naming the sample
    err = expect(http.post(seg, json=report(world, attempt=world["attempt"] - 1)), 409, "conflict")
    assert err["items"] == [{"id": world["sample"], "reason": "route lost: stale attempt or route token"}]
    err = expect(http.post(seg, json=report(world, route_token=str(uuid.uuid4()))), 409, "conflict")  # a guessed token
    assert err["items"] == [{"id": world["sample"], "reason": "route lost: stale attempt or route token"}]
    expect(http.post(seg, json=report(world, route_token="guess")), 422, "invalid_input")
    expect(
        http.post(
            seg, json={"reports": [{k: v for k, v in report(world)["reports"][0].items() if k != "route_token"}]}
        ),
        422,
        "invalid_input",
    )
    # the old path, without the instance: gone, pointing at the new one
    err = expect(http.post(f"/v1/runs/{run}/segments", json=report(world)), 410, "gone")
    assert "/instances/" in err["message"]
    expect(
        http.post(
            f"/v1/runs/{run}/rewards",
            json={"rewards": [{"sample_id": world["sample"], "reward_attempt": 1, "reward": 1.0}]},
        ),
        409,
        "conflict",
    )
    expect(http.post(seg, json=report(world, version=3)), 422, "invalid_input")  # a version the run never had

    # out of order: consume or publish another version than the run's, or with a stale consume fence
    expect(http.post(f"/v1/runs/{run}/batches/1/consume"), 409, "conflict")
    expect(http.post(f"/v1/runs/{run}/batches/1/publish", json={"consume_fence": 1}), 409, "conflict")
    expect(http.post(f"/v1/runs/{run}/batches/0/publish", json={"consume_fence": 1}), 409, "conflict")  # not ready

    # unknown ids, and ids of another run
    expect(http.get("/v1/runs/999999"), 404, "not_found")
    expect(http.post(f"/v1/runs/{run}/instances/999999/heartbeat", json={"version": 0}), 404, "not_found")
    expect(http.post(f"/v1/runs/{run}/instances/{world['other_inst']}/poll"), 404, "not_found")
    expect(http.post(seg, json=report(world, sample_id=999999)), 404, "not_found")
    expect(http.post(f"/v1/runs/{run}/routes", json={"routes": [{"sample_id": 999999, "instance_id": inst}]}), 404)
    expect(http.post(f"/v1/runs/{run}/groups/999999/abort", json={}), 404, "not_found")
    expect(http.delete("/v1/tokens/999999"), 404, "not_found")
    expect(http.post("/v1/tokens", json={"role": "rollout", "run_id": 999999}), 404, "not_found")

    # malformed: NUL, NaN, unknown fields, broken JSON, out-of-range ints, wrong methods and paths
    expect(http.post("/v1/runs", json={"name": "a\x00b", "config": {"batch_size": 1, "group_size": 1, "eta": 0}}), 422)
    nan = '{"rewards": [{"sample_id": 1, "reward_attempt": 1, "reward": NaN}]}'
    expect(http.post(f"/v1/runs/{run}/rewards", content=nan, headers={"Content-Type": "application/json"}), 422)
    expect(http.post(seg, json={**report(world), "extra": 1}), 422, "invalid_input")
    expect(http.post(seg, content=b"{not json", headers={"Content-Type": "application/json"}), 422)
    expect(http.post(seg, json=report(world, version=2**31)), 422)
    expect(http.post(seg, json=report(world, logprobs=[-0.1, -0.2])), 422)  # not aligned with tokens
    expect(
        http.post(
            f"/v1/runs/{run}/prompts",
            json={"prompts": [{"client_key": "m", "prompt_tokens": [1], "meta": {"x": "\x00"}}]},
        ),
        422,
    )
    expect(
        http.post(
            "/v1/runs",
            json={"name": "bad", "config": {"batch_size": 2, "group_size": 1, "eta": 0, "buffer_capacity": 1}},
        ),
        422,
        "invalid_input",
    )
    expect(http.get("/v1/runs/abc"), 404, "not_found")  # a name no run has
    expect(http.get(f"/v1/runs/{2**63}"), 422)  # digits are an id: out of range
    expect(http.put(f"/v1/runs/{run}"), 405, "method_not_allowed")
    expect(http.get("/v1/nothing-here"), 404, "not_found")
    expect(http.post(seg, json=report(world), headers={"Idempotency-Key": "has space"}), 422)
    expect(http.post(f"/v1/runs/{run}/instances/{world['other_inst']}/segments", json=report(world)), 404, "not_found")
    expect(
        http.post(
            f"/v1/runs/{run}/routes", json={"routes": [{"sample_id": world["sample"], "instance_id": inst}], "epoch": 7}
        ),
        409,
        "conflict",
    )  # not the leader's epoch

    assert fingerprint(engine) == before


def test_request_id_replays_outcome_and_refuses_other_body(world):
    http, run = world["http"], world["run"]
    key = {"Idempotency-Key": "rep-1"}
    seg = f"/v1/runs/{run}/instances/{world['inst']}/segments"
    first = http.post(seg, json=report(world, kind="partial"), headers=key)
    assert first.status_code == 200 and first.json() == {"applied": 1}
    before = fingerprint(world["engine"])
    again = http.post(seg, json=report(world, kind="partial"), headers=key)
    assert again.status_code == 200 and again.json() == first.json()
    assert fingerprint(world["engine"]) == before  # replayed, not applied twice
    expect(http.post(seg, json=report(world, tokens=[6]), headers=key), 409, "idempotency_key_reused")
    # the same key in another run is another request
    other = http.post(
        "/v1/runs",
        json={"name": "x", "config": {"batch_size": 1, "group_size": 1, "eta": 0}},
        headers={"Idempotency-Key": "rep-1"},
    )
    assert other.status_code == 201


def test_validation_errors_name_the_field(world):
    r = world["http"].post("/v1/runs", json={"name": "", "config": {"batch_size": 0, "group_size": 1, "eta": 0}})
    err = expect(r, 422, "invalid_input")
    assert "name" in err["message"] and "config.batch_size" in err["message"]
    assert {tuple(d["loc"]) for d in err["details"]} == {("body", "name"), ("body", "config", "batch_size")}
    assert json.loads(r.text)["error"]["code"] == "invalid_input"


def test_a_batch_naming_an_id_twice_is_refused_and_changes_nothing(world):
    http, run, sample, inst = world["http"], world["run"], world["sample"], world["inst"]
    before = fingerprint(world["engine"])
    for key in (None, "twice-1"):  # with a request id the refusal is not stored either
        headers = {"Idempotency-Key": key} if key else {}
        body = {"sample_ids": [sample, sample]}
        err = expect(http.post(f"/v1/runs/{run}/commands/interrupt", json=body, headers=headers), 422, "invalid_input")
        assert err["message"] == f"sample {sample} appears twice in one interrupt batch"
        body = {"instance_ids": [inst, inst]}
        err = expect(http.post(f"/v1/runs/{run}/commands/pull", json=body, headers=headers), 422, "invalid_input")
        assert err["message"] == f"instance {inst} appears twice in one pull batch"
    assert fingerprint(world["engine"]) == before
    # once each, the same calls (and the request id) are taken
    ok = http.post(
        f"/v1/runs/{run}/commands/interrupt", json={"sample_ids": [sample]}, headers={"Idempotency-Key": "twice-1"}
    )
    assert ok.status_code == 200 and ok.json() == {"commands": 1}
    assert http.post(f"/v1/runs/{run}/commands/pull", json={"instance_ids": [inst]}).json() == {"commands": 1}


def test_idempotency_keys_are_visible_ascii_without_spaces(world):
    http, run = world["http"], world["run"]
    seg = f"/v1/runs/{run}/instances/{world['inst']}/segments"
    before = fingerprint(world["engine"])
    for bad in ("has space", " lead", "tab\there", "x" * 201):
        err = expect(http.post(seg, json=report(world, kind="partial"), headers={"Idempotency-Key": bad}), 422)
        assert [d["loc"] for d in err["details"]] == [["header", "Idempotency-Key"]], err
    assert fingerprint(world["engine"]) == before
    # every visible character from "!" to "~" is allowed, up to 200 of them
    key = "".join(chr(c) for c in range(0x21, 0x7F)) + "k" * 106
    first = http.post(seg, json=report(world, kind="partial"), headers={"Idempotency-Key": key})
    assert first.status_code == 200 and first.json() == {"applied": 1}
    after = fingerprint(world["engine"])
    again = http.post(seg, json=report(world, kind="partial"), headers={"Idempotency-Key": key})
    assert again.status_code == 200 and again.json() == first.json() and fingerprint(world["engine"]) == after
    header = next(
        p
        for p in http.get("/openapi.json").json()["paths"]["/v1/runs/{run_id}/routes"]["post"]["parameters"]
        if p["name"] == "Idempotency-Key"
    )
    assert header["schema"]["anyOf"][0] == {
        "type": "string",
        "minLength": 1,
        "maxLength": 200,
        "pattern": r"^[\x21-\x7e]+$",
    }
    assert "no spaces" in header["description"]


def _keys(node):
    """Every key of every object in a JSON document."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield k
            yield from _keys(v)
    elif isinstance(node, list):
        for v in node:
            yield from _keys(v)


def test_the_schema_states_bounds_and_reserved_keys_in_json_schema_terms(world):
    http, run = world["http"], world["run"]
    spec = http.get("/openapi.json").json()
    assert {"ge", "le"}.isdisjoint(_keys(spec))  # pydantic's names, which schema tools ignore
    schemas = spec["components"]["schemas"]
    listed, packed = schemas["ReportIn"]["properties"]["logprobs"]["anyOf"]  # a JSON list or packed
    assert listed["items"] == {"type": "number", "minimum": -3.0e38, "maximum": 3.0e38}
    assert (packed["type"], packed["contentEncoding"]) == ("string", "base64")
    ttl = schemas["HeartbeatIn"]["properties"]["lease_seconds"]
    assert (ttl["type"], ttl["minimum"], ttl["maximum"]) == ("number", 1.0, 3600.0)
    reward = schemas["RewardIn"]["properties"]["reward"]
    assert (reward["minimum"], reward["maximum"]) == (-1e300, 1e300)

    # client keys starting with "~" are the data layer's (re-enqueued filtered groups)
    key = schemas["PromptIn"]["properties"]["client_key"]
    assert key["pattern"] == r"^[^~\x00][^\x00]*$" and "`~`" in key["description"]
    before = fingerprint(world["engine"])
    for reserved in ("~r1:k", "~"):
        body = {"prompts": [{"client_key": reserved, "prompt_tokens": [1]}]}
        err = expect(http.post(f"/v1/runs/{run}/prompts", json=body), 422, "invalid_input")
        assert [d["loc"] for d in err["details"]] == [["body", "prompts", "0", "client_key"]], err
    assert fingerprint(world["engine"]) == before
    body = {"prompts": [{"client_key": "a~b", "prompt_tokens": [1]}]}  # "~" elsewhere is the caller's
    assert http.post(f"/v1/runs/{run}/prompts", json=body).status_code == 200


def test_an_oversized_body_is_refused_before_any_endpoint_runs(world):
    """The limit (64 KiB here) is a JSON 413 naming it, for a declared length and a chunked
    body alike, and comes before the endpoint: one that reads no body (deregistering an
    instance) does not run either."""
    http, run, inst = world["http"], world["run"], world["inst"]
    before = fingerprint(world["engine"])
    big = b" " * 70_000
    gone = f"/v1/runs/{run}/instances/{inst}"
    for body in (lambda: big, lambda: iter([big[:40_000], big[40_000:]])):  # declared length, chunked
        err = expect(http.request("DELETE", gone, content=body()), 413, "too_large")
        assert err["message"] == f"request body over {64 * 1024} bytes"
        expect(http.post(f"{gone}/segments", content=body()), 413, "too_large")
    assert fingerprint(world["engine"]) == before
    assert http.delete(gone).status_code == 200  # without the body it is taken
    assert fingerprint(world["engine"]) != before
