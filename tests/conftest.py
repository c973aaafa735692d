"""Shared fixtures: one real PostgreSQL server per test process, a fresh database per test.

The server is the one in ``STALEFLOW_TEST_DATABASE_URL`` (a libpq URL of any database
on a server where we may CREATE DATABASE) or else an embedded server in a temporary
STALEFLOW_HOME, started with unsafe-but-fast settings. Each pytest(-xdist) process
migrates its own template database once; every test gets a copy of it.

Fixtures:
  admin_url     session   libpq URL of the maintenance database (CREATE/DROP DATABASE ...)
  template_db   session   name of the migrated template database
  db_url        function  libpq URL of a fresh migrated database, dropped afterwards;
                          also exported as STALEFLOW_DATABASE_URL for the test's duration
  engine        function  make_engine(db_url), disposed afterwards
  embedded_pg   function  an unstarted EmbeddedPostgres in its own temp home (for tests
                          that stop/restart a server); stopped and deleted afterwards

Tests using admin_url/template_db/db_url/engine are marked ``db`` automatically; a test
reaching the database some other way marks itself with ``@pytest.mark.db``. .ci/run
re-runs ``-m db`` against a standalone server.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from staleflow_db import migrate
from staleflow_db.db import make_engine, with_database
from staleflow_db.embedded import EmbeddedPostgres
from staleflow_db.settings import to_libpq_url

# Tests only: durability is worthless here, speed is not.
FAST_OPTIONS = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "200",
}
DB_FIXTURES = {"admin_url", "template_db", "db_url", "engine"}

_session_home: Path | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _session_home
    # A stray database_url() in a test must never touch the developer's own
    # ~/.staleflow server or their STALEFLOW_DATABASE_URL.
    os.environ.pop("STALEFLOW_DATABASE_URL", None)
    _session_home = Path(tempfile.mkdtemp(prefix="sf-test-"))
    os.environ["STALEFLOW_HOME"] = str(_session_home)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _session_home is not None:
        _discard_home(_session_home)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & DB_FIXTURES:
            item.add_marker(pytest.mark.db)
        if "embedded_pg" in names:
            item.add_marker(pytest.mark.embedded)


def _discard_home(home: Path) -> None:
    try:
        EmbeddedPostgres(home).stop()
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _admin(url: str) -> psycopg.Connection:
    return psycopg.connect(url, autocommit=True, connect_timeout=10)


def _drop_database(admin_url: str, name: str) -> None:
    # WITH (FORCE) terminates sessions a test left open (PostgreSQL 13+).
    with _admin(admin_url) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture(scope="session")
def admin_url() -> Iterator[str]:
    external = os.environ.get("STALEFLOW_TEST_DATABASE_URL", "").strip()
    if external:
        yield to_libpq_url(external)
        return
    assert _session_home is not None
    pg = EmbeddedPostgres(_session_home, server_options=FAST_OPTIONS)
    with pg.running():
        yield pg.url("postgres")


@pytest.fixture(scope="session")
def template_db(admin_url: str) -> Iterator[str]:
    # Unique per xdist worker and process: parallel runs on one server don't collide.
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    name = f"sf_tmpl_{worker}_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    with _admin(admin_url) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        if migrate.head() is not None:
            migrate.upgrade(with_database(admin_url, name))
        yield name
    finally:
        _drop_database(admin_url, name)


@pytest.fixture
def db_url(admin_url: str, template_db: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = f"sf_t_{uuid.uuid4().hex[:16]}"
    with _admin(admin_url) as conn:
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name), sql.Identifier(template_db))
        )
    url = with_database(admin_url, name)
    # Code under test that calls database_url() itself, and subprocesses, land here too.
    monkeypatch.setenv("STALEFLOW_DATABASE_URL", url)
    try:
        yield url
    finally:
        _drop_database(admin_url, name)


@pytest.fixture
def engine(db_url: str):
    eng = make_engine(db_url)
    try:
        yield eng
    finally:
        eng.dispose()


@pytest.fixture
def embedded_pg() -> Iterator[EmbeddedPostgres]:
    home = Path(tempfile.mkdtemp(prefix="sf-emb-"))
    try:
        yield EmbeddedPostgres(home, server_options=FAST_OPTIONS)
    finally:
        _discard_home(home)


@pytest.fixture
def start_ps(tmp_path):
    """Start parameter servers in their own processes (torch); stopped at teardown."""
    from ps_helpers import PSProcess

    started: list = []

    def start(**kw):
        ps = PSProcess(tmp_path / "ps", **kw)
        started.append(ps)
        return ps

    yield start
    for ps in started:
        if ps.proc.is_alive():
            ps.stop()


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny ops: intra-op threads only add contention on a shared CPU (see TorchEngine).
    A module of tiny-model tests asks for it with `pytest.mark.usefixtures`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
