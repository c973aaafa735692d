"""List parameters dumped by `staleflow_db.arrays` reach PostgreSQL as psycopg's own dumper
sends them: the same values, the same array type; a list of bytes goes in binary form."""

from __future__ import annotations

import random
import uuid

import psycopg
from psycopg.adapt import PyFormat, Transformer
from psycopg.pq import Format

from staleflow_db import arrays

EDGES = [
    [1, 2, 3],
    [1, 2**40],
    [2**70],
    [0.5, -1e-5, 1e300, 3.0, float("inf"), float("nan"), -0.0],
    [1, None],
    [None, 1.5],
    [None, None],
    [str(uuid.uuid4()) for _ in range(3)],
    ["sample_routed", "group_reserved"],
    ["null", "x"],
    ["NuLl"],
    [""],
    ["a", ""],
    ["a,b"],
    ["a,b", "c"],
    ['{"v":0}'],
    ["é"],
    ["x\ty"],
    ["a", None],
    [[1, 2], [3, 4]],
    [True, False],
    [b"\x00\x01\xff", b"\\x", b'"{,}'],
    [b""],
    [b"ab", None],
    [None, b"ab"],
    [bytearray(b"\xff\x00"), memoryview(b"xy")],
    [[b"a", None], [b"", b"\x00"]],
]


def some_lists(n: int) -> list[list]:
    rng = random.Random(7)
    makers = [
        lambda: rng.randint(-(2**62), 2**62),
        lambda: rng.uniform(-1e9, 1e9),
        lambda: rng.choice([None, rng.randint(0, 9)]),
        lambda: "".join(rng.choice('ab_-.:{}" ,\\nNUL') for _ in range(rng.randint(0, 4))),
        lambda: rng.choice([None, rng.randbytes(rng.randint(0, 12))]),
    ]
    return [[make() for _ in range(rng.randint(1, 6))] for make in (rng.choice(makers) for _ in range(n))]


def sent(conn: psycopg.Connection, value: list) -> object:
    """The value as the server read it and its type, or the error's class (a list of strings
    has no type of its own: an untyped parameter)."""
    try:
        with conn.transaction():
            return conn.execute("SELECT CAST(%s AS text[])::text, pg_typeof(%s)::text", (value, value)).fetchone()
    except psycopg.Error as e:
        with conn.transaction():
            return type(e).__name__, conn.execute("SELECT CAST(%s AS text[])::text", (value,)).fetchone()


def test_lists_reach_the_server_as_psycopg_sends_them(db_url):
    with psycopg.connect(db_url) as plain, psycopg.connect(db_url) as fast:
        arrays.register(fast)
        for value in EDGES + some_lists(500):
            got = [sent(conn, value) for conn in (plain, fast)]
            assert got[0] == got[1], value


def test_a_list_of_bytes_is_sent_in_binary_form(db_url):
    cases = [
        ([b"\x00" * 340, None], Format.BINARY),
        ([memoryview(b"xy"), bytearray(b"z")], Format.BINARY),
        ([[b"a"], [b"b"]], Format.BINARY),
        ([1, 2], Format.TEXT),
        (["a"], Format.TEXT),
    ]
    with psycopg.connect(db_url) as conn:
        arrays.register(conn)
        sent_as = [Transformer(conn).get_dumper(value, PyFormat.AUTO).format for value, _ in cases]
    assert sent_as == [expected for _, expected in cases]
