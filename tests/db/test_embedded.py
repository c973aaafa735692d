"""The embedded PostgreSQL manager, against real servers in temporary homes."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from staleflow_db import embedded
from staleflow_db.embedded import EmbeddedPostgres, pg_bin

pytestmark = pytest.mark.embedded


def test_start_reuse_stop(embedded_pg: EmbeddedPostgres) -> None:
    assert not embedded_pg.is_running()
    assert embedded_pg.start() is True
    first = embedded_pg.info()
    assert first is not None and first.status == "ready"

    # A second manager (as another process would build) reuses the same server.
    again = EmbeddedPostgres(embedded_pg.home)
    assert again.start() is False
    second = again.info()
    assert second is not None and (second.pid, second.port) == (first.pid, first.port)
    assert again.url() == embedded_pg.url() == (f"postgresql://postgres@127.0.0.1:{first.port}/staleflow")

    with psycopg.connect(again.url()) as conn:
        assert conn.execute("SELECT current_database()").fetchone() == ("staleflow",)
        # listen on loopback only
        assert conn.execute("SHOW listen_addresses").fetchone() == ("127.0.0.1",)

    assert again.stop() is True
    assert not embedded_pg.is_running()
    assert embedded_pg.stop() is False
    with pytest.raises(embedded.EmbeddedPostgresError):
        embedded_pg.url()


def test_data_and_port_persist_across_restart(embedded_pg: EmbeddedPostgres) -> None:
    embedded_pg.start()
    port = embedded_pg.info().port
    with psycopg.connect(embedded_pg.url()) as conn:
        conn.execute("CREATE TABLE kept (x int)")
        conn.execute("INSERT INTO kept VALUES (42)")
    embedded_pg.stop()

    assert embedded_pg.start() is True
    assert embedded_pg.info().port == port
    with psycopg.connect(embedded_pg.url()) as conn:
        assert conn.execute("SELECT x FROM kept").fetchall() == [(42,)]


def test_server_options_apply(embedded_pg: EmbeddedPostgres) -> None:
    embedded_pg.start()
    with psycopg.connect(embedded_pg.url()) as conn:
        assert conn.execute("SHOW fsync").fetchone() == ("off",)
        assert conn.execute("SHOW max_connections").fetchone() == ("200",)


def test_context_manager_stops_only_what_it_started(embedded_pg: EmbeddedPostgres) -> None:
    with embedded_pg.running() as pg:
        assert pg.is_running()
        pid = pg.info().pid
        # Nested use finds it running and must leave it running.
        with EmbeddedPostgres(embedded_pg.home).running():
            pass
        assert pg.is_running() and pg.info().pid == pid
    assert not embedded_pg.is_running()


def test_concurrent_first_starts_share_one_server(embedded_pg: EmbeddedPostgres) -> None:
    # Several processes start at once on a fresh home: the file lock must give one
    # initdb and one server, and every process the same URL.
    code = "import sys; from staleflow_db.embedded import ensure_running; print(ensure_running(sys.argv[1]))"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(embedded_pg.home)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    urls = {out.strip() for out, _ in outs}
    assert urls == {embedded_pg.url()}
    assert not list(embedded_pg.home.glob("pgdata.init-*"))


def test_pidfile_naming_another_live_process_is_ignored(embedded_pg: EmbeddedPostgres) -> None:
    embedded_pg.start()
    embedded_pg.stop()
    # As after a reboot: the recorded pid now belongs to some unrelated process.
    (embedded_pg.pgdata / "postmaster.pid").write_text(f"{os.getpid()}\n{embedded_pg.pgdata}\n")
    assert not embedded_pg.is_running()
    assert embedded_pg.start() is True
    assert embedded_pg.info().pid != os.getpid()


def test_refuses_foreign_non_empty_pgdata(embedded_pg: EmbeddedPostgres) -> None:
    embedded_pg.pgdata.mkdir(parents=True)
    (embedded_pg.pgdata / "something").write_text("not a cluster")
    with pytest.raises(embedded.EmbeddedPostgresError, match="no PG_VERSION"):
        embedded_pg.start()
    assert (embedded_pg.pgdata / "something").exists()


@pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0, reason="root only")
def test_runs_as_system_user_when_root(embedded_pg: EmbeddedPostgres) -> None:
    embedded_pg.start()
    owner = pwd.getpwuid(embedded_pg.pgdata.stat().st_uid).pw_name
    assert owner == embedded.SYSTEM_USER
    import psutil

    assert psutil.Process(embedded_pg.info().pid).username() == embedded.SYSTEM_USER


def test_module_level_helpers(embedded_pg: EmbeddedPostgres) -> None:
    url = embedded.ensure_running(embedded_pg.home)
    assert url == embedded_pg.url()
    assert embedded.stop(embedded_pg.home) is True
    assert embedded.stop(embedded_pg.home) is False


def test_pg_bin() -> None:
    pgbench = pg_bin("pgbench")
    assert isinstance(pgbench, Path) and os.access(pgbench, os.X_OK)
    out = subprocess.run([str(pgbench), "--version"], capture_output=True, text=True, check=True)
    assert "pgbench" in out.stdout
    with pytest.raises(FileNotFoundError):
        pg_bin("no-such-program")


def test_taken_port_is_replaced(embedded_pg: EmbeddedPostgres) -> None:
    import socket

    embedded_pg.start()
    old = embedded_pg.info().port
    embedded_pg.stop()
    with socket.socket() as squatter:
        # REUSEADDR: the stopped server's connections may linger in TIME_WAIT.
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", old))
        squatter.listen()
        assert embedded_pg.start() is True
        new = embedded_pg.info().port
    assert new != old
    assert (embedded_pg.pgdata / embedded.PORT_FILE).read_text().strip() == str(new)
