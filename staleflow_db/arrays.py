"""List parameters dumped in one join instead of element by element.

psycopg dumps a list parameter in Python, one element at a time, each checked against a regular
expression for quoting, even with its C implementation: a route or record_rewards call of 128
samples sends some twenty arrays (ids, versions, route tokens, event kinds ...), and dumping
them took about a third of the client's CPU in that call. A flat list of ints or of floats (NULLs
allowed), or of strings that need no quoting, has the text `{a,b,...}`: one `str.join`, checked
once. A list of bytes (a report's packed token ids and log-probs, one per segment) goes in
binary form: its elements as they are, each behind its length. As text each byte was two hex
digits that the server's array parser then read back one character at a time: for a report of
85 segments of 85 tokens that parse alone cost the database ~1.8 ms of CPU against ~0.2 ms in
binary. The type psycopg picks for the array (int2[] ... numeric[], float8[], bytea[],
unknown: `upgrade`), and so the statements' prepared forms, stay as they were; any other list
is dumped as before."""

from __future__ import annotations

import re
import struct
from typing import Any

from psycopg.abc import Buffer
from psycopg.adapt import PyFormat
from psycopg.types.array import BaseListDumper, ListBinaryDumper, ListDumper

NoneType = type(None)
BYTEA_OID, BYTEA_ARRAY_OID = 17, 1001
# array_recv's header of a one-dimensional array: dimensions, has-NULLs flag, element type,
# then the dimension's length and lower bound
_ARRAY_HEADER = struct.Struct("!iiIii")
_LENGTH = struct.Struct("!i")
_NULL = _LENGTH.pack(-1)
# strings PostgreSQL's array input reads unquoted as themselves: no delimiter, brace, quote,
# backslash or white space, not empty, and not the word NULL (checked apart)
_PLAIN = re.compile(r"[0-9A-Za-z_.:+\-]+(?:,[0-9A-Za-z_.:+\-]+)*")


class NumberListDumper(ListDumper):
    """psycopg's text list dumper, with one join for a flat list of numbers or plain strings; a
    list of bytes goes binary (`ByteaListDumper`) where psycopg may choose the format."""

    def upgrade(self, obj: list[Any], format: PyFormat) -> BaseListDumper:
        dumper = super().upgrade(obj, format)
        # the key psycopg caches the choice under is the elements' type: decided by it alone
        if format == PyFormat.AUTO and dumper.oid == BYTEA_ARRAY_OID:
            return ByteaListDumper(list, self._tx).upgrade(obj, PyFormat.BINARY)
        return dumper

    def dump(self, obj: list[Any]) -> Buffer | None:
        if obj and self.delimiter == b",":
            kinds = {type(x) for x in obj}
            if kinds <= {int, NoneType} or kinds <= {float, NoneType}:
                # str(float) is its shortest repr, which float8in reads back exactly
                items = map(str, obj) if NoneType not in kinds else ("NULL" if x is None else str(x) for x in obj)
                return ("{" + ",".join(items) + "}").encode()
            if kinds == {str}:
                text = ",".join(obj)
                plain = _PLAIN.fullmatch(text) and text.count(",") == len(obj) - 1  # no comma of their own
                if plain and ",NULL," not in f",{text.upper()},":
                    return ("{" + text + "}").encode()
        return super().dump(obj)


class ByteaListDumper(ListBinaryDumper):
    """psycopg's binary list dumper, with a flat list of bytes (NULLs allowed) in one join:
    array_recv's header, then each element's length and bytes."""

    def dump(self, obj: list[Any]) -> Buffer | None:
        if any(isinstance(x, list) for x in obj):
            return super().dump(obj)
        parts = [_ARRAY_HEADER.pack(1, None in obj, BYTEA_OID, len(obj), 1)]
        for x in obj:
            if x is None:
                parts.append(_NULL)
            else:
                parts.append(_LENGTH.pack(len(x)))
                parts.append(x)
        return b"".join(parts)


def register(conn: Any) -> None:
    """Use it for list parameters on a psycopg connection (an engine's "connect" event)."""
    conn.adapters.register_dumper(list, NumberListDumper)
