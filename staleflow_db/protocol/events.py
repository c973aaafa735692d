"""The event log: one named row per protocol transition, appended in batched statements."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

from .. import queries


@dataclass(frozen=True)
class Event:
    kind: str  # e.g. sample_routed, group_occupied, published
    sample: int | None = None
    group: int | None = None
    buffer: int | None = None
    instance: int | None = None
    data: dict[str, Any] | None = None


def log_events(conn: Connection, run_id: int, events: Sequence[Event]) -> None:
    """Append the events to the run's log in one statement."""
    if events:
        conn.execute(queries.text("events_insert"), events_params(run_id, events))


def events_params(run_id: int, events: Sequence[Event], prefix: str = "") -> dict[str, Any]:
    return {
        f"{prefix}{k}": v
        for k, v in {
            "run": run_id,
            "k": [e.kind for e in events],
            "s": [e.sample for e in events],
            "g": [e.group for e in events],
            "b": [e.buffer for e in events],
            "i": [e.instance for e in events],
            # one JSON array for all the events' data (a json.dumps per event cost ~3x more)
            "d": json.dumps([e.data for e in events]),
        }.items()
    }
