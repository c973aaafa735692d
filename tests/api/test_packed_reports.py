"""Packed token ids and log-probs in reports, over real HTTP to a `staleflow serve` process: the
client sends them packed by default and the stored segment is the one the JSON-list form
stores; a packed array the API cannot take (bad base64, a length that is not whole 4-byte
elements, a negative id, a NaN, an out-of-range log-prob, counts that differ) is a 422 naming
the field, and nothing is applied."""

from __future__ import annotations

import base64
import struct

import httpx
import pytest
from api_helpers import ApiServer, token
from sqlalchemy import text

from staleflow_db.payloads import unpack_logprobs, unpack_tokens
from workers.wire.packed import pack_float32, pack_int32


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


@pytest.fixture
def routed(db_url, engine):
    """A served run with four samples routed to one instance: (server, client, run, inst, work)."""
    with ApiServer(db_url) as server:
        admin = server.client(token(db_url, "admin"))
        run = admin.create_run("packed", batch_size=1, group_size=4, eta=0, max_response_tokens=64).id
        inst = admin.register(run, "gpu0", 0).instance_id
        admin.enqueue(run, [("p", [1, 2, 3])])
        admin.route(run, [(q.sample_id, inst) for q in admin.snapshot(run).queued])
        work = admin.poll(run, inst, wait=0).work
        assert len(work) == 4
        yield server, admin, run, inst, work


def _stored(engine, sample_id):
    with engine.connect() as c:
        rows = c.execute(
            text("SELECT token_ids, logprobs FROM segments WHERE sample_id = :s ORDER BY seq"), {"s": sample_id}
        ).all()
    # the table keeps them packed (staleflow_db/payloads.py)
    return [(unpack_tokens(t), unpack_logprobs(lp)) for t, lp in rows]


def _report(w, tokens, logprobs, **kw):
    return {"sample_id": w.sample_id, "attempt": w.attempt, "route_token": w.route_token, "version": 0} | {
        "tokens": tokens,
        "logprobs": logprobs,
        "kind": "partial",
        **kw,
    }


def test_packed_and_listed_reports_store_the_same_segment(routed, engine):
    server, admin, run, inst, work = routed
    ids, lps = [5, 0, 2**31 - 1, 77], [-0.1, -2.5, -1e-3, -30.25]
    assert admin.packed  # the default
    sent: list[bytes] = []
    admin.http.event_hooks["request"].append(lambda r: sent.append(r.content))
    assert admin.report(run, inst, [_report(work[0], ids, lps)]) == 1
    assert b'"tokens":"' + pack_int32(ids).encode() + b'"' in sent[-1]  # packed on the wire
    listed = server.client(admin.token, packed=False)
    listed.http.event_hooks["request"].append(lambda r: sent.append(r.content))
    assert listed.report(run, inst, [_report(work[1], ids, lps)]) == 1
    assert b'"tokens":[5,0,2147483647,77]' in sent[-1]
    # the same float4 values either way (read back through their shortest text)
    ((t0, l0),), ((t1, l1),) = _stored(engine, work[0].sample_id), _stored(engine, work[1].sample_id)
    assert t0 == t1 == ids and l0 == l1 and [f32(x) for x in l0] == [f32(x) for x in lps]
    # both forms in one body, and a finishing packed segment: a claim sees its tokens
    both = [_report(work[0], pack_int32([9]), pack_float32([-0.5]), kind="finished"), _report(work[1], [8], [-0.5])]
    r = httpx.post(
        f"{server.url}/v1/runs/{run}/instances/{inst}/segments",
        json={"reports": both},
        headers={"Authorization": f"Bearer {admin.token}"},
    )
    assert r.status_code == 200, r.text
    (task,) = admin.claim(run, limit=1, wait=0)
    assert task.sample_id == work[0].sample_id and task.response_tokens == ids + [9]


def test_a_retry_in_the_other_form_replays(routed, engine):
    """A report's key is digested with its arrays packed: the same segment sent again under the
    same key, as JSON lists, is the same request (a replay, not 409), and is stored once."""
    server, admin, run, inst, work = routed
    ids, lps = [11, 12, 13], [-0.5, -0.25, -0.125]
    url = f"{server.url}/v1/runs/{run}/instances/{inst}/segments"
    headers = {"Authorization": f"Bearer {admin.token}", "Idempotency-Key": "either-form"}
    for tokens, logprobs in ((pack_int32(ids), pack_float32(lps)), (ids, lps)):
        r = httpx.post(url, json={"reports": [_report(work[0], tokens, logprobs)]}, headers=headers)
        assert r.status_code == 200 and r.json() == {"applied": 1}, r.text
    assert _stored(engine, work[0].sample_id) == [(ids, lps)]
    other = _report(work[0], pack_int32(ids), pack_float32([-0.5, -0.25, -0.5]))  # another value: another body
    r = httpx.post(url, json={"reports": [other]}, headers=headers)
    assert r.status_code == 409 and r.json()["error"]["code"] == "idempotency_key_reused", r.text


BAD = (
    ("tokens", "%%%", "not base64"),
    ("tokens", base64.b64encode(b"\x05\x00\x00\x00\x06\x00").decode(), "not a whole number"),
    ("tokens", base64.b64encode(struct.pack("<2i", 4, -4)).decode(), "negative"),
    ("logprobs", base64.b64encode(struct.pack("<2f", -0.5, float("nan"))).decode(), "finite"),
    ("logprobs", base64.b64encode(struct.pack("<2f", -0.5, -3.3e38)).decode(), "outside"),
    ("logprobs", base64.b64encode(b"\x00\x00\x80").decode(), "not a whole number"),
)


def test_bad_packed_arrays_are_422_naming_the_field(routed, engine):
    server, admin, run, inst, work = routed
    for field, value, fragment in BAD:
        good = _report(work[2], pack_int32([4, 5]), pack_float32([-0.5, -0.25]))
        bad = _report(work[3], pack_int32([4, 5]), pack_float32([-0.5, -0.25])) | {field: value}
        r = httpx.post(
            f"{server.url}/v1/runs/{run}/instances/{inst}/segments",
            json={"reports": [good, bad]},
            headers={"Authorization": f"Bearer {admin.token}", "Idempotency-Key": f"k-{field}-{len(value)}"},
        )
        assert r.status_code == 422, r.text
        details = r.json()["error"]["details"]
        assert [d["loc"] for d in details] == [["body", "reports", "1", field]], details  # the packed branch only
        assert fragment in details[0]["msg"], details
    assert _stored(engine, work[2].sample_id) == [] and _stored(engine, work[3].sample_id) == []


def test_packed_counts_that_differ_are_422(routed, engine):
    server, admin, run, inst, work = routed
    r = httpx.post(
        f"{server.url}/v1/runs/{run}/instances/{inst}/segments",
        json={"reports": [_report(work[0], pack_int32([1, 2, 3]), pack_float32([-0.5, -0.5]))]},
        headers={"Authorization": f"Bearer {admin.token}"},
    )
    assert r.status_code == 422, r.text
    assert "3 tokens but 2 log-probs" in r.json()["error"]["message"]
    assert _stored(engine, work[0].sample_id) == []


def test_a_packed_batch_is_the_listed_batch(routed):
    server, admin, run, inst, work = routed
    ids = [[3 + i, 40_000, 0, 2**31 - 1][: i + 1] for i in range(4)]
    reports = [_report(w, t, [-0.5 - j / 7 for j in range(len(t))], kind="finished") for w, t in zip(work, ids)]
    assert admin.report(run, inst, reports) == 4
    tasks = admin.claim(run, limit=4, wait=0)
    admin.record_rewards(run, [(t.sample_id, t.reward_attempt, float(t.sample_id % 2)) for t in tasks])
    sent: list[httpx.Request] = []
    admin.http.event_hooks["request"].append(sent.append)
    packed = admin.consume(run, 0, wait=0)
    assert sent[-1].url.params["packed"] == "true"
    listed = server.client(admin.token, packed=False).consume(run, 0, wait=0)
    assert packed is not None and listed is not None
    assert packed.consume_fence + 1 == listed.consume_fence
    # the same float4 log-probs: packed exactly, listed as their shortest decimals
    for g in (*packed.groups, *listed.groups):
        for s in g.samples:
            s.logprobs = [f32(x) for x in s.logprobs]
    assert packed.groups == listed.groups
    samples = {s.sample_id: s for g in packed.groups for s in g.samples}
    assert [samples[w.sample_id].tokens for w in work] == ids
    assert packed.groups[0].prompt_tokens == [1, 2, 3]
    # on the wire: strings, not lists
    raw = httpx.post(
        f"{server.url}/v1/runs/{run}/batches/0/consume",
        params={"packed": "true"},
        headers={"Authorization": f"Bearer {admin.token}"},
    ).json()
    sample = raw["batch"]["groups"][0]["samples"][0]
    assert isinstance(sample["tokens"], str) and isinstance(sample["logprobs"], str)
    assert isinstance(sample["loss_mask"], list)
