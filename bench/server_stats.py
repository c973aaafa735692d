"""What a benchmark's workload costs the database server, from the server's own counters and
processes: a scratch database to run it in, the CPU of the backends serving that database, and
what the workload wrote (WAL, commits, rows per table). Unlike rates, these barely move with the
load of a shared machine, so they show what a change to the data path saves."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg import sql

from staleflow_db import migrate
from staleflow_db.db import with_database


@contextmanager
def scratch_database(server_url: str, prefix: str = "sf_bench") -> Iterator[str]:
    """A new database on the server (libpq URL of any database there), migrated; dropped after."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        url = with_database(server_url, name)
        migrate.upgrade(url)
        yield url
    finally:
        with psycopg.connect(server_url, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def backend_cpu(url: str) -> dict[int, float]:
    """CPU seconds (user + system) so far of each PostgreSQL backend serving `url`'s database
    (their process titles name it), when the server runs on this machine and its processes are
    readable; else empty."""
    import psutil

    name = url.rsplit("/", 1)[1].split("?")[0]
    got = {}
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            if proc.info["name"] == "postgres" and name in " ".join(proc.info["cmdline"] or ()):
                t = proc.cpu_times()
                got[proc.pid] = t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return got


class BackendCPU:
    """`backend_cpu` sampled every 0.2 s while a workload runs (a `with` block), so backends
    that exit before the end keep what they used. `seconds`: their CPU over the block."""

    def __init__(self, url: str):
        self.url = url
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> None:
        for pid, seconds in backend_cpu(self.url).items():
            self.first.setdefault(pid, seconds)
            self.last[pid] = seconds

    def _loop(self) -> None:
        while not self.stop.wait(0.2):
            self._sample()

    def __enter__(self) -> BackendCPU:
        self._sample()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self._sample()

    @property
    def seconds(self) -> float:
        return sum(self.last[p] - self.first[p] for p in self.last)


# WAL is cluster-wide (pg_stat_wal): run on a server nothing else writes to; rows and commits
# are the scratch database's. The position is where WAL is inserted, which an asynchronous
# commit has not necessarily written yet.
WORK_SQL = (
    "SELECT w.wal_records, w.wal_bytes, w.wal_fpi, d.xact_commit, pg_current_wal_insert_lsn()::text,"
    " (SELECT coalesce(json_object_agg(relname, json_build_array(n_tup_ins, n_tup_upd, n_tup_hot_upd)), '{}')"
    "  FROM pg_stat_user_tables) FROM pg_stat_wal w, pg_stat_database d WHERE d.datname = current_database()"
)


# WAL records by what they do (pg_walinspect's "resource manager/record type"); the rest: other
WAL_KINDS = {
    "index inserts": ("Btree/INSERT_LEAF", "Btree/INSERT_UPPER", "Btree/INSERT_POST", "Btree/INSERT_META"),
    # a locking read's row lock, and heap_update's lock of the old version when the new one
    # goes to another page
    "row locks": ("Heap/LOCK", "Heap2/LOCK_UPDATED"),
    "row updates": ("Heap/UPDATE", "Heap/UPDATE+INIT", "Heap/HOT_UPDATE", "Heap/HOT_UPDATE+INIT"),
    "row inserts": ("Heap/INSERT", "Heap/INSERT+INIT", "Heap2/MULTI_INSERT", "Heap2/MULTI_INSERT+INIT"),
    "commits": ("Transaction/COMMIT",),
}


def db_work(url: str) -> dict:
    """The server's write counters now (subtract two with `work_per`)."""
    with psycopg.connect(url, autocommit=True) as c:
        records, nbytes, fpi, commits, lsn, tables = c.execute(WORK_SQL).fetchone()
    return {
        "wal_records": records,
        "wal_bytes": int(nbytes),
        "wal_fpi": fpi,
        "commits": commits,
        "tables": tables,
        "lsn": lsn,
        "url": url,
    }


def wal_kinds(before: dict, after: dict, n: int) -> dict[str, float]:
    """WAL records per unit of work by kind (`WAL_KINDS`), read back from the WAL between the two
    readings with pg_walinspect; empty where the extension cannot be had (not a superuser, not
    installed)."""
    try:
        with psycopg.connect(after["url"], autocommit=True) as c:
            c.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
            # pg_walinspect reads only flushed WAL: a commit that wrote a record of its own,
            # with synchronous_commit on, flushes it past `after` where the server commits
            # asynchronously (the tests')
            c.execute("SET synchronous_commit = on")
            with c.transaction():
                c.execute("SELECT pg_logical_emit_message(true, 'staleflow-bench', '')")
            rows = c.execute(
                'SELECT "resource_manager/record_type", count FROM pg_get_wal_stats(%s, %s, true) WHERE count > 0',
                (before["lsn"], after["lsn"]),
            ).fetchall()
    except psycopg.Error:
        return {}
    kind_of = {t: kind for kind, types in WAL_KINDS.items() for t in types}
    out = dict.fromkeys([*WAL_KINDS, "other"], 0.0)
    for record_type, count in rows:
        out[kind_of.get(record_type, "other")] += count / n
    return {k: round(v, 3) for k, v in out.items()}


def format_kinds(kinds: dict[str, float]) -> str:
    """`wal_kinds`' figures in a line: "index inserts 3.51, row locks 1.40, ..."."""
    return ", ".join(f"{kind} {n:.2f}" for kind, n in kinds.items()) or "n/a"


def work_per(before: dict, after: dict, n: int) -> dict:
    """Per unit of work (a transition, a pgbench transaction): WAL records, bytes and full-page
    images, the records by kind (`wal_kinds`), commits, and rows inserted / updated (of which
    HOT) per table."""
    out: dict = {k: round((after[k] - before[k]) / n, 3) for k in ("wal_records", "wal_bytes", "wal_fpi", "commits")}
    out["wal_kinds"] = wal_kinds(before, after, n)
    rows = {}
    for table, (ins, upd, hot) in after["tables"].items():
        i0, u0, h0 = before["tables"].get(table, (0, 0, 0))
        if ins - i0 or upd - u0:
            rows[table] = {"ins": round((ins - i0) / n, 3), "upd": round((upd - u0) / n, 3), "hot": hot - h0}
    out["rows"] = rows
    return out
