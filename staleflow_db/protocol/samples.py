"""The dashboard's sample browser: a run's samples filtered and paged by keyset, and one sample
with its segments, events and commands (`samples.sql`). Read-only, one short transaction each."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import Connection

from .. import queries
from ..errors import NotFound
from ..idempotency import transactional
from ..payload_store import ObjectCache
from ..payloads import unpack_tokens
from .core import TxMixin, load_run

STATUSES = ("trained", "rewarded", "in_flight", "dropped")
SCAN = 10_000  # the samples one page request looks at, at most


@dataclass(frozen=True)
class SamplePage:
    """`next_before`: where the next (older) page starts; None when there is none."""

    rows: list[dict[str, Any]]
    next_before: int | None


@dataclass(frozen=True)
class SampleFilter:
    """None: any. `statuses` from STATUSES; `step` the buffer the group occupies or trained in;
    the ranges are inclusive; `length` counts response tokens."""

    statuses: Sequence[str] | None = None
    step: int | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    staleness_min: int | None = None
    staleness_max: int | None = None
    length_min: int | None = None
    length_max: int | None = None


def _rows(conn: Connection, name: str, **params: Any) -> list[dict[str, Any]]:
    return [dict(r._mapping) for r in conn.execute(queries.text(name), params).all()]


def _segments(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each segment's token ids unpacked, read through the payload store where it holds them."""
    cache: ObjectCache | None = None
    for r in rows:
        url, size, sha, offset = (r.pop(k) for k in ("object_url", "object_size", "object_sha256", "payload_offset"))
        packed = r["token_ids"]
        if packed is None and url is not None:
            cache = cache or ObjectCache()
            packed, _ = cache.segment(url, size, sha, offset, r["n_tokens"])
        r["token_ids"] = unpack_tokens(packed)
    return rows


class SampleReads(TxMixin):
    @transactional
    def browse(
        self,
        run_id: int,
        where: SampleFilter,
        before: int | None,
        limit: int,
        scan: int = SCAN,
        *,
        conn: Connection | None = None,
    ) -> SamplePage:
        """Up to `limit` of the run's samples matching `where` with id < `before`, newest first,
        among the `scan` newest of those (so one request reads a bounded number of samples)."""
        params = asdict(where) | {"statuses": None if where.statuses is None else list(where.statuses)}
        with self.tx(conn) as conn:
            load_run(conn, run_id, lock=False)
            # one more than a page: a last page that happens to be full says so
            rows = _rows(conn, "sample_browse", run=run_id, before=before, n=limit + 1, scan=scan, **params)
            if len(rows) > limit:
                return SamplePage(rows[:limit], rows[limit - 1]["sample_id"])
            window = conn.execute(queries.text("sample_window"), {"run": run_id, "before": before, "scan": scan}).one()
        # fewer matched than a page: go on below a full window; a window not full reached the end
        return SamplePage(rows, window.oldest if window.scanned == scan else None)

    @transactional
    def sample(self, run_id: int, sample_id: int, *, conn: Connection | None = None) -> dict[str, Any]:
        """The sample with `segments`, `events` (its own, its group's, the publish of the step it
        trained in) and `commands`."""
        with self.tx(conn) as conn:
            rows = _rows(conn, "sample_one", run=run_id, sample=sample_id)
            if not rows:
                load_run(conn, run_id, lock=False)  # NotFound for the run first
                raise NotFound(f"sample {sample_id} of run {run_id}")
            found = rows[0]
            found["segments"] = _segments(_rows(conn, "sample_segments", sample=sample_id))
            trained = found["step"] if found["status"] == "trained" else None
            found["events"] = _rows(
                conn, "sample_events", run=run_id, sample=sample_id, group=found["group_id"], step=trained
            )
            found["commands"] = _rows(conn, "sample_commands", run=run_id, sample=sample_id)
        return found
