"""Refusals of protocol operations. Each one leaves the database unchanged.

The API maps them to HTTP: InvalidInput 422, NotFound 404, Conflict 409, TooLarge 413.
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
    """A lost lease, a stale attempt or a wrong version: the caller's view is out of date."""

    code = "conflict"

    def __init__(self, items: list[tuple[int, str]]):
        self.items = items
        shown = "; ".join(f"{key}: {why}" for key, why in items[:5])
        more = f" (+{len(items) - 5} more)" if len(items) > 5 else ""
        super().__init__(shown + more)
