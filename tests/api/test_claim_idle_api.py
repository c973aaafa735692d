"""A claim long-poll's idle re-check through the API (in process, on a real database): while
the run has nothing to claim, `POST …/rewards/claim` answers empty from one read sent in
autocommit (`claim_idle`), no transaction and no key lock; a finished sample or a lapsed claim
sends it through the transaction as before, and a keyed retry still replays its claim."""

from __future__ import annotations

import pytest
from api_helpers import in_process
from sqlalchemy import text
from statement_recorder import sent_with_autocommit as sent

from api.auth import create_token
from staleflow_db.protocol import Prompt, Protocol
from staleflow_db.types import Report, RunConfig

pytestmark = pytest.mark.db

IDLE_MARK = "SELECT EXISTS (SELECT 1 FROM runs WHERE id ="  # claim_idle's


def test_an_idle_claim_is_one_read_without_a_transaction(db_url, engine):
    p = Protocol(engine)
    run = p.create_run("claim-idle", RunConfig(batch_size=1, group_size=2, eta=1))
    (group,) = p.enqueue(run, [Prompt("p", [1, 2, 3])])
    auth = {"Authorization": f"Bearer {create_token(engine, 'reward', run)['token']}"}
    with in_process(db_url) as http:
        app_engine = http.app.state.staleflow.engine

        def claim(key: str | None = None) -> tuple[list[int], bool]:
            """The claimed sample ids, and whether the claim ran a transaction."""
            headers = auth | ({"Idempotency-Key": key} if key else {})
            with sent(app_engine) as statements:
                r = http.post(f"/v1/runs/{run}/rewards/claim", params={"wait": 0}, json={"limit": 1}, headers=headers)
            assert r.status_code == 200, r.text
            assert any(IDLE_MARK in s and auto for s, auto in statements)  # the check comes first, in autocommit
            claimed = [t["sample_id"] for t in r.json()["tasks"]]
            return claimed, any(not auto for s, auto in statements if "FROM api_tokens" not in s)  # auth, once

        assert claim() == ([], False) and claim("empty-1") == ([], False)
        inst = p.register_instance(run, "i", 0)
        with engine.connect() as c:
            a, b = c.execute(text("SELECT id FROM samples WHERE group_id = :g ORDER BY id"), {"g": group}).scalars()
        for r in p.route(run, [(a, inst), (b, inst)]):
            p.report(run, [Report(r.sample_id, r.attempt, 0, [5], [-0.5], instance_id=inst, route_token=r.route_token)])
        assert claim("k1") == ([a], True)
        assert claim("k1") == ([a], True)  # a retry replays its claim: not idle, though b is claimable
        assert claim() == ([b], True)
        assert claim() == ([], False)  # both claimed
        with engine.begin() as c:  # a's claim lapses: the next claim takes it back
            c.execute(text("UPDATE samples SET reward_deadline = now() - interval '1 s' WHERE id = :s"), {"s": a})
        assert claim() == ([a], True)
        assert claim("k1") == ([a], True)  # the first claim's outcome, still
        other = http.post(f"/v1/runs/{run + 99}/rewards/claim", params={"wait": 0}, json={"limit": 1}, headers=auth)
        assert other.status_code in (403, 404), other.text  # refused, not answered empty
