"""The auth matrix: every endpoint x every role, plus no token, a bad token and a token of
another run. Allowed callers get past auth (any status but 401/403: the ids here may not
exist); everyone else gets 401 (no or bad token) or 403 (wrong role or run). An instance's
own endpoints (/instances/{I}/...) also refuse a rollout token other than the registering one."""

from __future__ import annotations

import time
from typing import Any

import pytest

from api.auth import create_token, revoke_token
from staleflow_db.protocol import Protocol
from staleflow_db.types import RunConfig
from tests.api_helpers import ROLES, in_process

ALL = set(ROLES)
ADMIN = {"admin"}
TRAINER_COORD = {"admin", "trainer", "coordinator"}
ROLLOUT, REWARD, TRAINER, COORD = ({"admin", r} for r in ("rollout", "reward", "trainer", "coordinator"))
AUDITORS = TRAINER_COORD | {"observer"}

# (method, path, json body, allowed roles, status for an allowed token of *another* run)
# {A}: the run the tokens belong to. Bodies are valid, so allowed callers are not stopped at 422.
RUN_CFG = {"name": "made-by-matrix", "config": {"batch_size": 1, "group_size": 1, "eta": 0}}
MATRIX: list[tuple[str, str, Any, set[str], int]] = [
    ("POST", "/v1/runs", RUN_CFG, ADMIN, 403),
    ("GET", "/v1/runs", None, ALL, 200),  # lists only the token's own run
    ("GET", "/v1/runs/{A}", None, ALL, 403),
    ("GET", "/v1/runs/{A}/versions", None, ALL, 403),
    ("GET", "/v1/runs/{A}/param-secret", None, ROLLOUT | TRAINER, 403),
    ("POST", "/v1/runs/{A}/prompts", {"prompts": [{"client_key": "k", "prompt_tokens": [1]}]}, TRAINER_COORD, 403),
    ("POST", "/v1/tokens", {"role": "rollout", "run_id": "{A}"}, ADMIN, 403),
    ("GET", "/v1/tokens", None, ADMIN, 200),  # lists only the token's own run
    ("DELETE", "/v1/tokens/{T}", None, ADMIN, 403),  # a token of run A
    ("POST", "/v1/runs/{A}/instances", {"name": "i", "version": 0}, ROLLOUT, 403),
    ("POST", "/v1/runs/{A}/instances/{I}/heartbeat", {"version": 0}, ROLLOUT, 403),
    ("DELETE", "/v1/runs/{A}/instances/{I}", None, ROLLOUT, 403),
    ("POST", "/v1/runs/{A}/instances/{I}/poll?wait=0", None, ROLLOUT, 403),
    ("POST", "/v1/runs/{A}/instances/sync?wait=0", {"poll": ["{I}"]}, ROLLOUT, 403),  # another token's: 403 too
    (
        "POST",
        "/v1/runs/{A}/instances/{I}/segments",
        {
            "reports": [
                {
                    "sample_id": 1,
                    "attempt": 1,
                    "route_token": "00000000-0000-4000-8000-000000000000",
                    "version": 0,
                    "tokens": [],
                    "logprobs": [],
                }
            ]
        },
        ROLLOUT,
        403,
    ),
    (
        "POST",
        "/v1/runs/{A}/instances/{I}/drops",
        {"drops": [{"sample_id": 1, "attempt": 1, "route_token": "00000000-0000-4000-8000-000000000000"}]},
        ROLLOUT,
        403,
    ),
    ("POST", "/v1/runs/{A}/segments", None, ROLLOUT, 403),  # gone (410) for those who may report
    ("POST", "/v1/runs/{A}/rewards/claim?wait=0", {"limit": 1}, REWARD, 403),
    ("POST", "/v1/runs/{A}/rewards", {"rewards": [{"sample_id": 1, "reward_attempt": 1, "reward": 1.0}]}, REWARD, 403),
    ("POST", "/v1/runs/{A}/rewards/drop", {"drops": [{"sample_id": 1, "reward_attempt": 1}]}, REWARD, 403),
    ("POST", "/v1/runs/{A}/batches/0/consume?wait=0", None, TRAINER, 403),
    ("POST", "/v1/runs/{A}/batches/0/publish", {"consume_fence": 1}, TRAINER, 403),
    ("GET", "/v1/runs/{A}/snapshot", None, COORD | {"observer"}, 403),
    ("GET", "/v1/runs/{A}/snapshot/changes", None, COORD | {"observer"}, 403),
    # gone (410) for those who may coordinate
    ("POST", "/v1/runs/{A}/coordinator/lease", None, COORD, 403),
    ("POST", "/v1/runs/{A}/coordinator/release", None, COORD, 403),
    ("POST", "/v1/runs/{A}/coordinator/cycle", None, COORD, 403),
    ("POST", "/v1/runs/{A}/routes", {"routes": [{"sample_id": 1, "instance_id": 1}]}, COORD, 403),
    ("POST", "/v1/runs/{A}/commands/interrupt", {"sample_ids": [1]}, COORD, 403),
    ("POST", "/v1/runs/{A}/commands/pull", {"instance_ids": ["{I}"]}, COORD, 403),
    ("POST", "/v1/runs/{A}/samples/abort", {"sample_ids": [999999]}, COORD, 403),
    ("POST", "/v1/runs/{A}/groups/999999/abort", {}, COORD, 403),
    ("POST", "/v1/runs/{A}/abort-after-ready", None, COORD, 403),
    ("POST", "/v1/runs/{A}/instances/expire", None, COORD, 403),
    ("GET", "/v1/audit/trained?run_id={A}", None, AUDITORS, 403),
    ("GET", "/v1/audit/dropped?run_id={A}", None, AUDITORS, 403),
    ("GET", "/v1/audit/violations?run_id={A}", None, AUDITORS, 403),
    ("GET", "/v1/runs/{A}/lineage?step=0", None, {"admin", "observer"}, 403),
    ("GET", "/v1/runs/{A}/export", None, {"admin", "observer"}, 403),
    ("GET", "/v1/runs/{A}/dashboard", None, ALL, 403),
    ("GET", "/v1/runs/{A}/dashboard/steps", None, ALL, 403),
    ("GET", "/v1/runs/{A}/samples", None, ALL, 403),
    ("GET", "/v1/runs/{A}/samples/999999", None, ALL, 403),
    # last: a cancel answers the calls after it with 409, which is past auth all the same
    ("POST", "/v1/runs/{A}/pause", None, ADMIN, 403),
    ("POST", "/v1/runs/{A}/resume", {"reason": "matrix"}, ADMIN, 403),
    ("POST", "/v1/runs/{A}/cancel", None, ADMIN, 403),
]
PUBLIC = [("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/metrics")]


def _fill(value: Any, ids: dict[str, int]) -> Any:
    if isinstance(value, str):
        for k, v in ids.items():
            if value == "{" + k + "}":
                return v
            value = value.replace("{" + k + "}", str(v))
        return value
    if isinstance(value, dict):
        return {k: _fill(v, ids) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, ids) for v in value]
    return value


def test_every_endpoint_by_every_role(db_url, engine):
    p = Protocol(engine)
    run_a = p.create_run("a", RunConfig(batch_size=1, group_size=1, eta=0))
    run_b = p.create_run("b", RunConfig(batch_size=1, group_size=1, eta=0))
    mine_rows = {r: create_token(engine, r, run_a) for r in ROLES}
    mine = {r: row["token"] for r, row in mine_rows.items()}
    # I: registered by run A's rollout token (as over the API), so that token is its owner.
    instance = p.register_instance(run_a, "i", 0, token_id=mine_rows["rollout"]["id"])
    ids = {"A": run_a, "I": instance, "T": create_token(engine, "reward", run_a)["id"]}
    other_rollout = create_token(engine, "rollout", run_a)["token"]  # same run, not the owner
    mine["admin"] = create_token(engine, "admin")["token"]  # creating runs needs an all-runs admin
    theirs = {r: create_token(engine, r, run_b)["token"] for r in ROLES}
    scoped_admin = create_token(engine, "admin", run_a)["token"]

    failures: list[str] = []
    with in_process(db_url, max_wait=0.2) as http:
        schema = http.get("/openapi.json").json()["paths"]
        endpoints = {(m.upper(), path) for path, ops in schema.items() for m in ops if path.startswith("/v1")}
        covered = {(m, _fill(path, ids).split("?")[0]) for m, path, *_ in MATRIX}
        concrete = {
            (
                m,
                p.replace("{run_id}", str(run_a))
                .replace("{instance_id}", str(ids["I"]))
                .replace("{token_id}", str(ids["T"])),
            )
            for m, p in endpoints
        }
        assert {e for e in concrete if "{" not in e[1]} <= covered, "an endpoint is missing from the matrix"
        assert len(endpoints) == len(MATRIX) and len(covered) == len(MATRIX)

        def call(method: str, path: str, body: Any, tok: str | None) -> int:
            headers = {"Authorization": f"Bearer {tok}"} if tok else {}
            return http.request(method, path, json=body, headers=headers).status_code

        for method, path, body, allowed, other_run in MATRIX:
            instance_scoped = "/instances/{I}" in path
            path, body = _fill(path, ids), _fill(body, ids)
            where = f"{method} {path}"
            if instance_scoped and (got := call(method, path, body, other_rollout)) != 403:
                failures.append(f"{where} as another rollout token of the run: {got}, expected 403")
            for bad in (None, "sf_not-a-token"):
                if (got := call(method, path, body, bad)) != 401:
                    failures.append(f"{where} with token {bad!r}: {got}, expected 401")
            for role in ROLES:
                got = call(method, path, body, mine[role])
                if role in allowed and got in (401, 403):
                    failures.append(f"{where} as {role}: {got}, expected to pass auth")
                if role not in allowed and got != 403:
                    failures.append(f"{where} as {role}: {got}, expected 403")
            role = sorted(allowed - {"admin"})[0] if allowed != ADMIN and allowed != ALL else "admin"
            if (got := call(method, path, body, theirs[role])) != other_run:
                failures.append(f"{where} as {role} of another run: {got}, expected {other_run}")
            if method == "POST" and path == "/v1/runs" and call(method, path, body, scoped_admin) != 403:
                failures.append("a run-scoped admin created a run")
        for method, path in PUBLIC:
            if (got := call(method, path, None, None)) != 200:
                failures.append(f"{method} {path} without a token: {got}, expected 200")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("action", ["consume", "publish"])
def test_rollout_token_can_never_train(db_url, engine, action):
    run = Protocol(engine).create_run("r", RunConfig(batch_size=1, group_size=1, eta=0))
    rollout = create_token(engine, "rollout")["token"]  # even one valid for every run
    with in_process(db_url) as http:
        body = {"consume_fence": 1} if action == "publish" else None
        r = http.post(f"/v1/runs/{run}/batches/0/{action}", json=body, headers={"Authorization": f"Bearer {rollout}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"


def test_revoked_token_is_refused(db_url, engine):
    admin = create_token(engine, "admin")
    victim = create_token(engine, "trainer")
    with in_process(db_url, token_cache_seconds=0) as http:
        auth = {"Authorization": f"Bearer {victim['token']}"}
        assert http.get("/v1/runs", headers=auth).status_code == 200
        r = http.delete(f"/v1/tokens/{victim['id']}", headers={"Authorization": f"Bearer {admin['token']}"})
        assert r.json() == {"id": victim["id"], "revoked": True}
        r = http.get("/v1/runs", headers=auth)
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"


def test_cached_tokens_honour_revocation(db_url, engine):
    """Lookups are cached (STALEFLOW_API_TOKEN_CACHE_SECONDS): a revocation through this
    replica applies at once however long the cache; one made elsewhere (another replica, the
    CLI) within the cache time."""
    admin = create_token(engine, "admin")
    here, elsewhere = create_token(engine, "trainer"), create_token(engine, "trainer")
    with in_process(db_url, token_cache_seconds=1.0) as http:
        for t in (here, elsewhere):
            assert http.get("/v1/runs", headers={"Authorization": f"Bearer {t['token']}"}).status_code == 200
        r = http.delete(f"/v1/tokens/{here['id']}", headers={"Authorization": f"Bearer {admin['token']}"})
        assert r.json() == {"id": here["id"], "revoked": True}
        assert http.get("/v1/runs", headers={"Authorization": f"Bearer {here['token']}"}).status_code == 401

        assert revoke_token(engine, elsewhere["id"])
        revoked_at = time.monotonic()
        while True:
            sent = time.monotonic()  # a request sent after the cache time must be refused
            if http.get("/v1/runs", headers={"Authorization": f"Bearer {elsewhere['token']}"}).status_code == 401:
                break
            assert sent - revoked_at < 1.0, "accepted after the cache time"
            time.sleep(0.05)
