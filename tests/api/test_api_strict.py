"""Strict request types, over real HTTP (a `staleflow serve` process): coerced scalars ("4",
4.0, true for an integer; "0.5", true for a float; 1, "true" for a boolean) are refused with
422 naming the field at every write endpoint, and change nothing. Plus the behaviours
docs/api.md states about errors: 400, 403 vs 404, 405, interrupts of another run's sample,
prompt vs response length, run-scoped admins creating tokens, lapsed leases, publish rules."""

from __future__ import annotations

import copy
import socket
import time
import typing

import httpx
import pytest
from api_helpers import ApiServer
from protocol_helpers import Driver
from pydantic import TypeAdapter
from sqlalchemy import text
from test_api_errors import fingerprint

from api.auth import create_token
from staleflow_db.protocol import Prompt, Protocol
from staleflow_db.types import RunConfig
from workers.wire.models.common import In

INT, FLOAT, BOOL = "int", "float", "bool"
COERCED = {
    INT: lambda v: [str(v), float(v), True],
    FLOAT: lambda v: [str(v), True],
    BOOL: lambda v: [int(v), str(v).lower()],
}


def _world(engine):
    """Two runs; in the first a running sample (instance and attempt known) and a group."""
    p = Protocol(engine)
    d = Driver(engine, batch_size=1, group_size=1, eta=1, max_prompt_tokens=4, max_response_tokens=4)
    inst = p.register_instance(d.run, "gpu0", 0, lease_seconds=60)
    (g,) = d.enqueue(1)
    (s,) = d.members(g)
    attempt = d.routed([s], inst)[s]
    other = p.create_run("other", RunConfig(batch_size=1, group_size=1, eta=0))
    (og,) = p.enqueue(other, [Prompt("o", [1])])
    return d, inst, g, s, attempt, other, og


def _endpoints(
    run: int, inst: int, group: int, sample: int, attempt: int, route_token: str
) -> list[tuple[str, dict, list]]:
    """(path, valid body, [(path into the body, kind)]) for every write endpoint with a body."""
    r = f"/v1/runs/{run}"
    return [
        (
            "/v1/runs",
            {
                "name": "new",
                "config": {
                    "batch_size": 4,
                    "group_size": 2,
                    "eta": 1,
                    "buffer_capacity": 5,
                    "samples_per_group": 3,
                    "max_response_tokens": 16,
                    "max_prompt_tokens": 16,
                    "dapo_filter": False,
                },
            },
            [
                (("config", k), INT)
                for k in (
                    "batch_size",
                    "group_size",
                    "eta",
                    "buffer_capacity",
                    "samples_per_group",
                    "max_response_tokens",
                    "max_prompt_tokens",
                )
            ]
            + [(("config", "dapo_filter"), BOOL)],
        ),
        (
            f"{r}/prompts",
            {"prompts": [{"client_key": "k2", "prompt_tokens": [1, 2]}]},
            [(("prompts", 0, "prompt_tokens", 0), INT)],
        ),
        ("/v1/tokens", {"role": "rollout", "run_id": run}, [(("run_id",), INT)]),
        (
            f"{r}/instances",
            {"name": "gpu1", "version": 0, "lease_seconds": 30},
            [(("version",), INT), (("lease_seconds",), FLOAT)],
        ),
        (
            f"{r}/instances/{inst}/heartbeat",
            {
                "version": 0,
                "lease_seconds": 60,
                "snapshot": {
                    "running": 1,
                    "waiting": 0,
                    "kv_used": 3,
                    "throughput": 2.5,
                    "pulling": False,
                    "routed_seen": 1,
                    "capacity": {"max_running": 8, "kv_capacity": 100},
                    "running_samples": [{"sample_id": sample, "tokens": 0}],
                },
            },
            [(("version",), INT), (("lease_seconds",), FLOAT)]
            + [(("snapshot", k), INT) for k in ("running", "waiting", "kv_used", "routed_seen")]
            + [(("snapshot", "capacity", k), INT) for k in ("max_running", "kv_capacity")]
            + [
                (("snapshot", "throughput"), FLOAT),
                (("snapshot", "pulling"), BOOL),
                (("snapshot", "running_samples", 0, "sample_id"), INT),
                (("snapshot", "running_samples", 0, "tokens"), INT),
            ],
        ),
        (
            f"{r}/instances/{inst}/segments",
            {
                "reports": [
                    {
                        "sample_id": sample,
                        "attempt": attempt,
                        "route_token": route_token,
                        "version": 0,
                        "tokens": [5],
                        "logprobs": [-0.5],
                        "kind": "partial",
                    }
                ]
            },
            [(("reports", 0, k), INT) for k in ("sample_id", "attempt", "version")]
            + [(("reports", 0, "tokens", 0), INT), (("reports", 0, "logprobs", 0), FLOAT)],
        ),
        (f"{r}/rewards/claim", {"limit": 10, "claim_seconds": 30}, [(("limit",), INT), (("claim_seconds",), FLOAT)]),
        (
            f"{r}/rewards",
            {"rewards": [{"sample_id": sample, "reward_attempt": 1, "reward": 0.5}]},
            [
                (("rewards", 0, "sample_id"), INT),
                (("rewards", 0, "reward_attempt"), INT),
                (("rewards", 0, "reward"), FLOAT),
            ],
        ),
        (
            f"{r}/batches/0/publish",
            {"consume_fence": 1, "size_bytes": 10},
            [(("consume_fence",), INT), (("size_bytes",), INT)],
        ),
        (
            f"{r}/routes",
            {"routes": [{"sample_id": sample, "instance_id": inst}], "epoch": 1},
            [(("routes", 0, "sample_id"), INT), (("routes", 0, "instance_id"), INT), (("epoch",), INT)],
        ),
        (
            f"{r}/commands/interrupt",
            {"sample_ids": [sample], "epoch": 1},
            [(("sample_ids", 0), INT), (("epoch",), INT)],
        ),
        (
            f"{r}/commands/pull",
            {"instance_ids": [inst], "target_version": 0, "epoch": 1},
            [(("instance_ids", 0), INT), (("target_version",), INT), (("epoch",), INT)],
        ),
        (f"{r}/samples/abort", {"sample_ids": [sample], "epoch": 1}, [(("sample_ids", 0), INT), (("epoch",), INT)]),
        (f"{r}/groups/{group}/abort", {"epoch": 1}, [(("epoch",), INT)]),
    ]


def _set(body: dict, path: tuple, value) -> dict:
    out = copy.deepcopy(body)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def _get(body: dict, path: tuple):
    for key in path:
        body = body[key]
    return body


def test_coerced_scalars_are_refused_at_every_write_endpoint(db_url, engine):
    d, inst, group, sample, attempt, *_ = _world(engine)
    admin = create_token(engine, "admin")["token"]
    endpoints = _endpoints(d.run, inst, group, sample, attempt, d.route_identity(sample)["route_token"])
    before = fingerprint(engine)
    with (
        ApiServer(db_url) as server,
        httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {admin}"}) as http,
    ):
        tried = 0
        for url, body, fields in endpoints:
            for path, kind in fields:
                for bad in COERCED[kind](_get(body, path)):
                    r = http.post(url, json=_set(body, path, bad))
                    assert r.status_code == 422, (url, path, bad, r.text)
                    locs = [tuple(x["loc"]) for x in r.json()["error"]["details"]]
                    want = ("body", *map(str, path))
                    assert any(loc[: len(want)] == want for loc in locs), (url, path, bad, locs)
                    tried += 1
        assert fingerprint(engine) == before  # nothing changed
        # The untouched bodies are valid input: none of them is refused as such.
        for url, body, _ in endpoints:
            r = http.post(url, json=body)
            assert r.status_code not in (422, 500), (url, r.text)
        # a JSON integer is a number: fine for a float field
        assert http.post(f"/v1/runs/{d.run}/rewards/claim", json={"limit": 1, "claim_seconds": 30}).status_code == 200
    assert tried > 100


def test_every_request_model_field_is_strict():
    """Guard for new fields: every scalar field of every request model refuses coercion."""

    def request_models():
        seen, todo = set(), list(In.__subclasses__())
        while todo:
            cls = todo.pop()
            if cls not in seen:
                seen.add(cls)
                todo.extend(cls.__subclasses__())
        return seen

    def scalar(ann):
        """int, float or bool under Optional/Annotated, else None."""
        if typing.get_origin(ann) is typing.Annotated:
            return scalar(typing.get_args(ann)[0])
        if typing.get_origin(ann) in (typing.Union, __import__("types").UnionType):
            inner = [a for a in typing.get_args(ann) if a is not type(None)]
            return scalar(inner[0]) if len(inner) == 1 else None
        return ann if ann in (int, float, bool) else None

    checked = 0
    for cls in request_models():
        for field in cls.model_fields.values():
            kind = {int: INT, float: FLOAT, bool: BOOL}.get(scalar(field.annotation))
            if kind is None:
                continue
            ann = typing.Annotated[field.annotation, *field.metadata] if field.metadata else field.annotation
            adapter = TypeAdapter(ann)
            for bad in COERCED[kind]({INT: 1, FLOAT: 1.5, BOOL: True}[kind]):
                with pytest.raises(ValueError):  # pydantic's ValidationError is a ValueError
                    adapter.validate_python(bad)
                checked += 1
    assert checked > 40


def test_documented_error_behaviours(db_url, engine):
    d, inst, group, sample, attempt, other, other_group = _world(engine)
    admin = create_token(engine, "admin")["token"]
    scoped_admin = create_token(engine, "admin", d.run)["token"]
    with engine.connect() as c:
        other_sample = c.execute(text("SELECT id FROM samples WHERE group_id = :g"), {"g": other_group}).scalar()
    with (
        ApiServer(db_url) as server,
        httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {admin}"}) as http,
    ):
        scoped = {"Authorization": f"Bearer {scoped_admin}"}
        # 404 for an unknown run with an all-runs token, 403 with a run-scoped one
        assert http.get("/v1/runs/999999").status_code == 404
        assert http.get("/v1/runs/999999", headers=scoped).status_code == 403
        assert http.get(f"/v1/runs/{other}", headers=scoped).status_code == 403
        # 405 for a known path with another method
        r = http.put(f"/v1/runs/{d.run}")
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
        # 400 for malformed HTTP, from the HTTP server itself
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            assert sock.recv(100).startswith(b"HTTP/1.1 400")
        # an interrupt naming another run's sample (or an unknown one) is 404, nothing queued
        r = http.post(f"/v1/runs/{d.run}/commands/interrupt", json={"sample_ids": [other_sample]})
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
        assert (
            http.post(f"/v1/runs/{d.run}/commands/interrupt", json={"sample_ids": [sample, 999999]}).status_code == 404
        )
        assert d.scalars("SELECT count(*) FROM commands") == [0]
        assert http.post(f"/v1/runs/{d.run}/commands/interrupt", json={"sample_ids": [sample]}).json() == {
            "commands": 1
        }
        # prompt over max_prompt_tokens: 422; response over max_response_tokens: 413
        r = http.post(f"/v1/runs/{d.run}/prompts", json={"prompts": [{"client_key": "long", "prompt_tokens": [1] * 5}]})
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_input"
        r = http.post(
            f"/v1/runs/{d.run}/instances/{inst}/segments",
            json={
                "reports": [
                    {
                        "sample_id": sample,
                        "attempt": attempt,
                        "route_token": d.route_identity(sample)["route_token"],
                        "version": 0,
                        "tokens": [1] * 5,
                        "logprobs": [0.0] * 5,
                    }
                ]
            },
        )
        assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"
        # a run-scoped admin's token with run_id null (or absent) is a token for its own run
        for body in ({"role": "rollout", "run_id": None}, {"role": "rollout"}):
            r = http.post("/v1/tokens", json=body, headers=scoped)
            assert r.status_code == 201 and r.json()["run_id"] == d.run
        assert http.post("/v1/tokens", json={"role": "rollout", "run_id": other}, headers=scoped).status_code == 403
        assert http.post("/v1/tokens", json={"role": "rollout", "run_id": None}).json()["run_id"] is None
        # a heartbeat after the instance's lease lapsed: 409, register again
        r = http.post(f"/v1/runs/{d.run}/instances", json={"name": "short", "version": 0, "lease_seconds": 1})
        short = r.json()["instance_id"]
        deadline = time.monotonic() + 60
        while True:
            r = http.post(f"/v1/runs/{d.run}/instances/{short}/heartbeat", json={"version": 0, "lease_seconds": 1})
            if r.status_code != 200 or time.monotonic() > deadline:
                break
            time.sleep(1.5)  # longer than the lease: the next heartbeat comes too late
        assert r.status_code == 409 and "register again" in r.json()["error"]["message"]
