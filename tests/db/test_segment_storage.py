"""Where a checkpoint's segment row lives: whole in the heap, two to a page (migration 0021 and
the worker's CHECKPOINT_TOKENS together). With PostgreSQL's default TOAST target its arrays went
to TOAST, costing a compression attempt on incompressible data, chunks and their index entries."""

from __future__ import annotations

import random

from staleflow_db.types import Report
from tests.protocol_helpers import Driver
from workers.rollout.worker import CHECKPOINT_TOKENS
from workers.wire.enums import SegmentKind


def test_checkpoint_rows_stay_in_the_heap_two_to_a_page(engine):
    d = Driver(engine, batch_size=2, group_size=1, eta=1)
    iid = d.p.register_instance(d.run, "i0", 0)
    attempts = d.routed(d.enqueue(2), iid)
    rng = random.Random(0)  # incompressible, as real token ids and log-probs are
    n = CHECKPOINT_TOKENS
    d.p.report(
        d.run,
        [
            Report(
                s,
                a,
                0,
                [rng.randrange(150_000) for _ in range(n)],
                [-rng.expovariate(1.0) for _ in range(n)],
                SegmentKind.PARTIAL,
                **d.route_identity(s),
            )
            for s, a in attempts.items()
        ],
    )
    assert d.scalars("SELECT octet_length(token_ids) + octet_length(logprobs) FROM segments") == [8 * n] * 2
    toast = d.one("SELECT pg_relation_size(reltoastrelid) FROM pg_class WHERE oid = 'segments'::regclass")[0]
    assert toast == 0, "a checkpoint's arrays went to TOAST"
    pages = d.scalars("SELECT (ctid::text::point)[0] FROM segments")
    assert len(pages) == 2 and len(set(pages)) == 1, f"the two rows on heap pages {pages}: one a page"
