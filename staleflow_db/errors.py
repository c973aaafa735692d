"""Refusals of protocol operations. Each one leaves the database unchanged.

The API maps them to HTTP: InvalidInput 422, NotFound 404, Conflict 409 (Corrupted too, code
`corrupted`; RunNotActive, code `run_not_active`), TooLarge 413.
"""

from __future__ import annotations


class ProtocolError(Exception):
    code = "protocol_error"


class InvalidInput(ProtocolError):
    code = "invalid_input"


class TooLarge(InvalidInput):
    code = "too_large"


class NotFound(ProtocolError):
    code = "not_found"


class Conflict(ProtocolError):
    """A lost route, fence or leadership, a stale attempt or a wrong version: the caller's view is out of date."""

    code = "conflict"

    def __init__(self, items: list[tuple[int, str]]):
        self.items = items
        shown = "; ".join(f"{key}: {why}" for key, why in items[:5])
        more = f" (+{len(items) - 5} more)" if len(items) > 5 else ""
        super().__init__(shown + more)


class Corrupted(Conflict):
    """The rows contradict the history they come from (what the audit reports as a violation),
    so the operation is refused rather than acted on: e.g. a consume whose batch holds a group
    the event log says was placed, and trained, elsewhere. A 409, with its own code."""

    code = "corrupted"


class RunNotActive(Conflict):
    """The run is cancelled (or paused, for what a pause stops): the operation is refused, its
    message naming the state. A 409, with its own code."""

    code = "run_not_active"

    def __init__(self, run_id: int, message: str):
        super().__init__([(run_id, message)])
        self.args = (message,)

    def __str__(self) -> str:
        return str(self.args[0])
