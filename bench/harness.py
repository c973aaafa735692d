"""Shared pieces of the chaos and load benchmarks: a private embedded PostgreSQL (its own
STALEFLOW_HOME, never the user's) that can be stopped cleanly or SIGKILLed and started again on
the same port, and a supervisor that restarts killed processes the way systemd or Kubernetes
would — only the killed ones: a process that exits on its own is recorded as a failure."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
# Run as scripts, bench/ would come first on sys.path and bench/api.py shadow the `api` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _REPO / "bench"]
if str(_REPO) not in sys.path:
    sys.path.append(str(_REPO))

from staleflow_cli.launch import Cluster, Proc
from staleflow_db import migrate
from staleflow_db.embedded import EmbeddedPostgres, EmbeddedPostgresError

# Durable settings (fsync on): a killed postmaster must recover by WAL replay, as in production.
SERVER_OPTIONS = {"max_connections": "200"}


class PrivatePostgres:
    """The embedded server of one private home, with the outages the chaos run inflicts."""

    def __init__(self, home: Path, options: dict[str, str] | None = None):
        self.pg = EmbeddedPostgres(home, server_options={**SERVER_OPTIONS, **(options or {})})

    def start(self, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while True:  # after a SIGKILL, orphaned backends hold the shared memory for a moment
            try:
                self.pg.start()
                return self.pg.url()
            except EmbeddedPostgresError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def url(self, database: str | None = None) -> str:
        return self.pg.url(database)

    def stop_fast(self) -> None:
        """`pg_ctl stop -m fast`: sessions rolled back, a clean shutdown checkpoint."""
        self.pg.stop()

    def kill_postmaster(self) -> int:
        """SIGKILL the postmaster (its backends notice and exit): crash recovery on the next start."""
        info = self.pg.info()
        if info is None:
            raise EmbeddedPostgresError("the private PostgreSQL is not running")
        os.kill(info.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while self.pg.info() is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        return info.pid

    def max_connections(self) -> int:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as c:
            return int(c.execute("SHOW max_connections").fetchone()[0])


@contextmanager
def private_postgres(home: Path, options: dict[str, str] | None = None) -> Iterator[str]:
    """A migrated private server for the duration; stopped afterwards. Yields its URL."""
    server = PrivatePostgres(home, options)
    url = server.start()
    try:
        migrate.upgrade(url)
        yield url
    finally:
        server.stop_fast()


@dataclass
class Role:
    """How to start (and restart) one supervised process."""

    name: str
    kind: str  # api, coordinator, rollout, reward, trainer, ps
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Record:
    kills: dict[str, int] = field(default_factory=dict)  # by kind
    restarts: int = 0
    exited: list[tuple[str, int, str]] = field(default_factory=list)  # (name, code, log tail) on their own


class Supervisor(Cluster):
    """A Cluster whose processes are restarted when we kill them; one log per name, appended."""

    def __init__(self, workdir: Path, db_url: str, env: dict[str, str] | None = None):
        super().__init__(workdir, db_url, env)
        self.roles: dict[str, Role] = {}
        self.current: dict[str, Proc] = {}
        self.record = Record()
        self._killed: set[int] = set()  # pids we SIGKILLed: their exit is expected

    def launch(self, role: Role) -> Proc:
        self.roles[role.name] = role
        proc = self.spawn(role.name, role.args, env=role.env, essential=False)
        self.current[role.name] = proc
        return proc

    def kill(self, name: str) -> None:
        """SIGKILL the process group (a torch process may have helpers), then restart it."""
        proc = self.current[name]
        self._killed.add(proc.popen.pid)
        try:
            os.killpg(proc.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.popen.wait()
        kind = self.roles[name].kind
        self.record.kills[kind] = self.record.kills.get(kind, 0) + 1
        self.restart(name)

    def restart(self, name: str) -> Proc:
        self.record.restarts += 1
        with open(self.current[name].log, "ab") as f:
            f.write(f"\n===== restarted by the chaos supervisor at {time.strftime('%H:%M:%S')} =====\n".encode())
        return self.launch(self.roles[name])

    def reap(self, restart_exited: bool = True) -> list[str]:
        """Processes that exited on their own since the last call: recorded as failures and
        (by default) restarted, so the run can go on and show what else breaks."""
        out = []
        for name, proc in list(self.current.items()):
            rc = proc.popen.poll()
            if rc is None or proc.popen.pid in self._killed:
                continue
            self.record.exited.append((name, rc, proc.tail(15)))
            out.append(name)
            if restart_exited:
                self.restart(name)
        return out

    def stop(self, name: str | None = None, timeout: float = 20.0) -> None:
        self._killed.update(p.popen.pid for p in self.procs if name is None or p.name == name)  # expected exits
        super().stop(name, timeout)

    def alive(self, names: Sequence[str] | None = None) -> bool:
        return all(self.current[n].popen.poll() is None for n in (names or self.current))
