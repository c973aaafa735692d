"""Migration 0015 converts segment payloads both ways without changing a bit: packed bytes down
to int[] / real[] (0014) and back, including the int32 extremes and float32 edge values
(subnormal, infinities, -0.0, NaN), and the audit still finds nothing on the trajectory."""

from __future__ import annotations

import math
import struct

from audit_helpers import forge
from sqlalchemy import text

from staleflow_db import migrate
from staleflow_db.payloads import pack_logprobs, pack_tokens, unpack_logprobs, unpack_tokens
from tests.db.test_turns import turns  # noqa: F401  (the fixture: a trajectory of turns trained at step 1)

EDGE_TOKENS = [-(2**31), 2**31 - 1, 0, -1, 151_000]
EDGE_LOGPROBS = [struct.unpack("<f", b"\x01\x00\x00\x80")[0], -3.4e38, -math.inf, -0.0, math.nan]


def _packed(engine) -> list[tuple]:
    with engine.connect() as c:
        return [
            tuple(r)
            for r in c.execute(
                text("SELECT sample_id, seq, token_ids, logprobs, n_tokens FROM segments ORDER BY 1, 2")
            ).all()
        ]


def test_0015_converts_payloads_down_and_up_bit_for_bit(db_url, turns):  # noqa: F811
    d, a = turns
    forge(
        d.engine,
        "INSERT INTO segments (sample_id, seq, run_id, version, instance_id, attempt, token_ids, logprobs, n_tokens)"
        " SELECT sample_id, 99, run_id, version, instance_id, attempt, :t, :l, :n FROM segments"
        " WHERE sample_id = :s AND seq = 0",
        s=a,
        t=pack_tokens(EDGE_TOKENS),
        l=pack_logprobs(EDGE_LOGPROBS),
        n=len(EDGE_TOKENS),
    )
    before = _packed(d.engine)
    assert len(before) > 4
    d.engine.dispose()

    migrate.downgrade(db_url, "0014")
    with d.engine.connect() as c:
        arrays = c.execute(text("SELECT sample_id, seq, token_ids, logprobs FROM segments ORDER BY 1, 2")).all()
    d.engine.dispose()
    for (s, q, tb, lb, n), (s2, q2, ta, la) in zip(before, arrays, strict=True):
        assert (s, q, n) == (s2, q2, len(ta))
        assert ta == unpack_tokens(tb)
        assert struct.pack(f"<{len(la)}f", *la) == bytes(lb)  # every float32 bit, NaN and -0.0 too

    migrate.upgrade(db_url)
    assert _packed(d.engine) == before
    forge(d.engine, "DELETE FROM segments WHERE sample_id = :s AND seq = 99", s=a)
    assert d.violations() == []
    assert unpack_logprobs(pack_logprobs([-0.5])) == [-0.5]
