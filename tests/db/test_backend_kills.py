"""Backend kills: worker processes drive one run through the protocol while another process
terminates their PostgreSQL backends at random moments (idle, mid-transaction, at commit).
Rollout workers make each instance's calls apart; a node worker hosts three instances and makes
theirs together, in node syncs and node polls.

Every call is journaled as acked, refused or unknown (the connection died under it). At the
end the database must hold every acked outcome, none of the refused ones, each unknown one
whole or not at all, no duplicated segment, contiguous versions, and an empty
`staleness_violations`. The check lives in bench/backend_kills.py (whose `--seconds` runs the
same thing for longer), the workers and the killer in bench/backend_kills_workers.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.backend_kills import check, drive, setup_run
from staleflow_db.payloads import pack_tokens

SECONDS = 20  # CI size: the workers' deadline; set-up, join and check add a few seconds

pytestmark = [pytest.mark.db, pytest.mark.slow]


def test_backend_kills_lose_nothing_acknowledged(engine, db_url, tmp_path):
    run = setup_run(engine, prompts=120)
    logs = drive(db_url, run, tmp_path, SECONDS)
    result = check(engine, run, logs)
    print({k: v for k, v in result.items() if k != "problems"})
    assert not result["problems"], "\n".join(result["problems"][:40])
    # not vacuous: backends died under the workers, some mid-transaction, and the run moved on
    assert sum(result["kills"].values()) >= 10, result["kills"]
    assert result["kills"].get("active", 0) + result["kills"].get("idle in transaction", 0) > 0, result["kills"]
    assert result["outcomes"].get("unknown", 0) > 0 and result["outcomes"].get("acked", 0) > 100, result["outcomes"]
    assert result["version"] >= 2, result
    assert result["node_syncs"].get("acked", 0) > 10, result["node_syncs"]
    node_reports = [c for c in logs["node-0"]["calls"] if c["op"] == "report" and c["outcome"] == "acked"]
    assert len(node_reports) > 10, len(node_reports)


def test_check_catches_forged_losses(engine, db_url, tmp_path):
    """The check is an oracle: forge an acked segment lost, an acked reward changed, an acked
    publish rolled back and a node sync never answered half applied, and it must name each."""
    from sqlalchemy import text

    run = setup_run(engine, prompts=60)
    logs = drive(db_url, run, tmp_path, 10)
    assert check(engine, run, logs)["problems"] == []
    calls = [c for name, log in logs.items() if name != "killer" for c in log["calls"] if c.get("outcome") == "acked"]
    report = next(c for c in calls if c["op"] == "report" and c["items"][0][2])
    reward = next(c for c in calls if c["op"] == "reward")
    publish = [c for c in calls if c["op"] == "publish"][-1:]  # none if a slow machine trained nothing yet
    sid, att, toks = report["items"][0]
    with engine.begin() as c:
        c.execute(text("ALTER TABLE segments DISABLE TRIGGER USER"))  # forging: bypass any guard
        c.execute(
            text("DELETE FROM segments WHERE sample_id = :s AND attempt = :a AND token_ids = :t"),
            {"s": sid, "a": att, "t": pack_tokens(toks)},
        )
        c.execute(text("UPDATE samples SET reward = reward + 7 WHERE id = :s"), {"s": reward["items"][0][0]})
        for pub in publish:
            c.execute(
                text("DELETE FROM param_versions WHERE run_id = :r AND version = :v"),
                {"r": run, "v": pub["version"] + 1},
            )
    # a node sync never answered whose item is found half applied: one report of an instance's
    # item in the database (an acked one), the other (tokens never generated) not
    seg = next(
        c["items"][0]
        for c in logs["node-0"]["calls"]
        if c["op"] == "report" and c["outcome"] == "acked" and c["items"][0][2] and c["items"][0] != [sid, att, toks]
    )
    logs["node-0"]["calls"].append(
        {
            "op": "node_sync",
            "worker": "node-0",
            "n": 0,
            "outcome": "unknown",
            "request_id": "forged",
            "parts": {"7": [seg, [seg[0] + 1, 1, [424242]]]},
        }
    )
    problems = "\n".join(check(engine, run, logs)["problems"])
    assert "node sync item of instance 7 half applied" in problems, problems
    assert f"acked report missing: [[{sid}, {att}," in problems, problems
    assert "acked rewards missing" in problems, problems
    for pub in publish:
        assert f"acked publish of v{pub['version'] + 1} missing" in problems, problems
