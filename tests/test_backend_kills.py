"""Backend kills: worker processes drive one run through the protocol while another process
terminates their PostgreSQL backends at random moments (idle, mid-transaction, at commit).

Every call is journaled as acked, refused or unknown (the connection died under it). At the
end the database must hold every acked outcome, none of the refused ones, each unknown one
whole or not at all, no duplicated segment, contiguous versions, and an empty
`staleness_violations`. The workers and the check live in bench/backend_kills.py, whose
`--seconds` runs the same thing for longer.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.backend_kills import check, drive, setup_run  # noqa: E402

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
