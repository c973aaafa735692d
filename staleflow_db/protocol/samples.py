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
from .core import TxMixin, load_run

STATUSES = ("trained", "rewarded", "in_flight", "dropped")


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


class SampleReads(TxMixin):
    @transactional
    def browse(
        self, run_id: int, where: SampleFilter, before: int | None, limit: int, *, conn: Connection | None = None
    ) -> list[dict[str, Any]]:
        """Up to `limit` of the run's samples matching `where` with id < `before`, newest first."""
        params = asdict(where) | {"statuses": None if where.statuses is None else list(where.statuses)}
        with self.tx(conn) as conn:
            load_run(conn, run_id, lock=False)
            return _rows(conn, "sample_browse", run=run_id, before=before, n=limit, **params)

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
            found["segments"] = _rows(conn, "sample_segments", sample=sample_id)
            trained = found["step"] if found["status"] == "trained" else None
            found["events"] = _rows(
                conn, "sample_events", run=run_id, sample=sample_id, group=found["group_id"], step=trained
            )
            found["commands"] = _rows(conn, "sample_commands", run=run_id, sample=sample_id)
        return found
