"""Lists of numbers as array parameters, dumped in one join instead of element by element.

psycopg dumps a list parameter in Python, one element at a time, each checked against a regular
expression for quoting, even with its C implementation: a route or record_rewards call of 128
samples sends some twenty arrays, and dumping them took about a third of the client's CPU in
that call. A list of plain ints (or of plain floats) needs no quoting, so its text is one
`str.join`. The type psycopg picks for the array (int2[] ... numeric[], float8[]: `upgrade`)
and so the statements' prepared forms stay as they were; any other list is dumped as before."""

from __future__ import annotations

from typing import Any

from psycopg.abc import Buffer
from psycopg.types.array import ListDumper


class NumberListDumper(ListDumper):
    """psycopg's text list dumper, with one join for a flat list of ints or of floats."""

    def dump(self, obj: list[Any]) -> Buffer | None:
        if obj and (all(type(x) is int for x in obj) or all(type(x) is float for x in obj)):
            # str(float) is its shortest repr, which float8in reads back exactly
            return ("{" + ",".join(map(str, obj)) + "}").encode()
        return super().dump(obj)


def register(conn: Any) -> None:
    """Use it for list parameters on a psycopg connection (an engine's "connect" event)."""
    conn.adapters.register_dumper(list, NumberListDumper)
