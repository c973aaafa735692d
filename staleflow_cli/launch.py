"""Start StaleFlow's processes on one machine, the way an operator would across many: each is
a `staleflow ...` command of its own, with its own log file. Used by `staleflow demo` and the
real-service benchmark."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from tenacity import RetryCallState

from workers.retry import READY


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the kernel's pick; another process may take it before the
    caller binds it). The one such helper: the launchers, the tests and the benchmarks use it
    (the embedded PostgreSQL keeps its own, which picks below the ephemeral range)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    essential: bool = True  # its death fails the whole job

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class ProcessDied(RuntimeError):
    pass


def wait_until(ready: Callable[[], bool], timeout: float, interval: float, failure: Callable[[], str]) -> None:
    """Call `ready` every `interval` seconds until it is true (its exceptions propagate);
    ProcessDied with `failure()` once `timeout` seconds passed."""

    def give_up(state: RetryCallState) -> None:
        raise ProcessDied(failure())

    READY.but(initial=interval, cap=interval, retry_for=timeout).retrying(until=bool, give_up=give_up)(ready)


class Cluster:
    """Processes sharing one database URL; stopped together (SIGTERM, then SIGKILL)."""

    def __init__(self, workdir: Path, db_url: str, env: dict[str, str] | None = None):
        self.workdir, self.db_url = workdir, db_url
        (workdir / "logs").mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "STALEFLOW_DATABASE_URL": db_url, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.procs: list[Proc] = []
        self.api_url: str | None = None

    def spawn(self, name: str, args: Sequence[str], env: dict[str, str] | None = None, essential: bool = True) -> Proc:
        log = self.workdir / "logs" / f"{name}.log"
        handle = open(log, "ab")
        popen = subprocess.Popen(
            [sys.executable, "-m", "staleflow_cli.main", *args],
            env={**self.env, **(env or {})},
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        handle.close()
        proc = Proc(name, popen, log, essential)
        self.procs.append(proc)
        return proc

    def start_api(self, timeout: float = 60.0) -> str:
        port = free_port()
        self.spawn("api", ["serve", "--port", str(port), "--no-upgrade"])
        url = f"http://127.0.0.1:{port}"
        api = self.procs[-1]

        def ready() -> bool:
            self.check()
            try:
                return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout, 0.2, lambda: f"the API did not become ready within {timeout:.0f}s\n{api.tail()}")
        self.api_url = url
        self.env["STALEFLOW_API_URL"] = url
        return url

    def wait_file(self, path: Path, timeout: float = 60.0) -> None:
        def exists() -> bool:
            self.check()
            return path.exists()

        wait_until(exists, timeout, 0.1, lambda: f"{path} did not appear within {timeout:.0f}s")

    def check(self) -> None:
        """Raise if an essential process exited (with the end of its log)."""
        for p in self.procs:
            rc = p.popen.poll()
            if rc is not None and p.essential:
                raise ProcessDied(f"{p.name} exited with code {rc}; its log ends:\n{p.tail()}")

    def stop(self, name: str | None = None, timeout: float = 20.0) -> None:
        """Stop the process `name`, or all of them: every worker at once, then the API replicas
        (the workers deregister and send their last reports through them: stopped together, a
        worker would wait out its outage retries for the API it lost)."""
        if name is not None:
            self.terminate([p for p in self.procs if p.name == name], timeout)
            return
        self.terminate([p for p in self.procs if not p.name.startswith("api")], timeout)
        self.terminate(self.procs, timeout)

    @staticmethod
    def terminate(targets: Sequence[Proc], timeout: float = 20.0) -> None:
        """SIGTERM them all at once, then SIGKILL the process group of any still running after
        `timeout` seconds."""
        for p in targets:
            p.essential = False
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in targets:
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.popen.pid, signal.SIGKILL)
                p.popen.wait()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
