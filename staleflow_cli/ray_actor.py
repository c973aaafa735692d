"""One StaleFlow role inside a Ray actor (used by ``staleflow launch ray``).

The actor runs the role's own ``staleflow ...`` command as a subprocess, exactly as on one
machine, and keeps it running: an unexpected exit is restarted after a back-off, a clean exit
(code 0) is final. When Ray restarts the actor itself (its node died, ``max_restarts``), the
constructor runs again on the new node and so does the process.

Addresses are never configured: the API and parameter-server actors report theirs
(``address()``), and a role that needs them looks them up by actor name in the run's
namespace before each start, and again every few seconds; when one moved (its actor came back
on another node) the process is restarted with the new addresses.

Imported on every node of the cluster, so it needs nothing beyond the core install and ray.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, cast

import httpx
import ray

from staleflow_cli.launch import free_port
from workers.retry import RESTART

WATCH_S = 3.0  # how often dependencies' addresses are looked up again
STABLE_S = 60.0  # a process that ran this long restarts without back-off
ALL_API_S = 60.0  # how long a starting process waits for every API replica, not just one
PR_SET_PDEATHSIG = 1

try:  # loaded before any fork: the child must not import after fork
    _libc: Any = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - not Linux
    _libc = None


def _die_with_parent() -> None:
    # A node that is removed takes its actors down; without this their subprocesses would
    # live on, orphaned, beside the restarted ones.
    if _libc is not None and sys.platform.startswith("linux"):
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class RoleProcess:
    """`spec` (all plain data, built by staleflow_cli.launch_ray):

    name       actor name, also the log file's name
    kind       "api" / "ps" (they publish an address) or "worker"
    argv       the `staleflow` arguments (the API's --host/--port and the PS's are added here)
    env        extra environment (database URL, token, ...)
    logdir     where the log goes, on the node the actor runs on
    namespace  the run's Ray namespace
    api        names of the API actors whose URLs go in as --api-url (none: not needed)
    ps         name of the parameter-server actor whose address goes in as --ps, or None
    """

    def __init__(self, spec: dict[str, Any]):
        self.spec = spec
        self.name: str = spec["name"]
        self.host = ray.util.get_node_ip_address()
        self.logdir = Path(spec["logdir"])
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.log = self.logdir / f"{self.name}.log"
        self.proc: subprocess.Popen | None = None
        self.addr: str | None = None
        self.ready = threading.Event()  # addr is set
        self.stopping = threading.Event()
        self.done = False  # exited with code 0: not restarted
        self.starts = 0
        self.events: deque[str] = deque(maxlen=20)
        self.lock = threading.Lock()
        threading.Thread(target=self._supervise, name=f"supervise-{self.name}", daemon=True).start()

    # ---- what the launcher and the other actors call --------------------------------------

    def address(self, timeout: float = 120.0) -> str | None:
        """The API's URL or the PS's HOST:PORT once it serves (None if not within `timeout`)."""
        self.ready.wait(timeout)
        return self.addr

    def info(self) -> dict[str, Any]:
        proc = self.proc
        return {
            "name": self.name,
            "node_id": ray.get_runtime_context().get_node_id(),
            "host": self.host,
            "pid": proc.pid if proc else None,
            "running": proc is not None and proc.poll() is None,
            "starts": self.starts,
            "done": self.done,
            "address": self.addr,
            "events": list(self.events),
        }

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM the process (it finishes its current work and deregisters), SIGKILL its
        group after `timeout` seconds; it is not restarted."""
        self.stopping.set()
        with self.lock:
            proc = self.proc
        if proc is None:
            return None
        return self._terminate(proc, timeout)

    # ---- the supervisor thread (it also owns the child: PDEATHSIG follows the thread) -----

    def _note(self, what: str) -> None:
        self.events.append(f"{time.strftime('%H:%M:%S')} {what}")
        with open(self.log, "a") as f:
            f.write(f"[staleflow launch ray] {what}\n")

    def _supervise(self) -> None:
        failures = 0  # in a row, each waited out by the RESTART policy
        while not self.stopping.is_set():
            deps = self._resolve(wait=True)
            if deps is None:  # stopping
                return
            argv = self._argv(deps)
            started = time.monotonic()
            with self.lock:
                if self.stopping.is_set():
                    return
                self.proc = self._spawn(argv)
                self.starts += 1
            self._note(f"start #{self.starts} on {self.host}: staleflow {' '.join(argv)}")
            moved = self._watch(self.proc, deps)
            rc = self.proc.poll()
            if self.stopping.is_set():
                return
            if moved:
                self._note(f"restarting: {moved}")
                self._terminate(self.proc, 20.0)
                continue
            if rc == 0:
                self.done = True
                self._note("exited cleanly; not restarted")
                return
            if time.monotonic() - started > STABLE_S:
                failures = 0
            failures += 1
            delay = RESTART.delay(failures)
            self._note(f"exited with code {rc}; restarting in {delay:.0f}s")
            self.stopping.wait(delay)

    def _spawn(self, argv: list[str]) -> subprocess.Popen:
        self.addr = None
        self.ready.clear()
        with open(self.log, "ab") as out:  # the child keeps its own descriptor
            return subprocess.Popen(
                [sys.executable, "-m", "staleflow_cli.main", *argv],
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.spec["env"]},
                cwd=self.logdir,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    def _argv(self, deps: dict[str, Any]) -> list[str]:
        argv = list(self.spec["argv"])
        kind = self.spec["kind"]
        if kind == "api":
            self.port = free_port(self.host)
            argv += ["--host", self.host, "--port", str(self.port)]
        elif kind == "ps":
            self.ready_file = self.logdir / f"{self.name}.ready.json"
            self.ready_file.unlink(missing_ok=True)
            argv += ["--host", self.host, "--port", "0", "--ready-file", str(self.ready_file)]
        for url in deps["api"]:
            argv += ["--api-url", url]
        if deps["ps"]:
            argv += ["--ps", deps["ps"]]
        return argv

    def _watch(self, proc: subprocess.Popen, deps: dict[str, Any]) -> str | None:
        """Until the process exits or stopping: publish this actor's address once it serves;
        return why to restart if a dependency moved."""
        last = time.monotonic()
        while proc.poll() is None and not self.stopping.wait(0.2):
            if not self.ready.is_set():
                self._check_ready()
            if time.monotonic() - last < WATCH_S:
                continue
            last = time.monotonic()
            now = self._resolve(wait=False)
            if now is None:
                continue
            new_api = set(now["api"]) - set(deps["api"])
            if new_api:  # a replica came back elsewhere (one that is down is failed over)
                return f"API replica moved to {', '.join(sorted(new_api))}"
            if now["ps"] and now["ps"] != deps["ps"]:
                return f"parameter server moved to {now['ps']}"
        return None

    def _check_ready(self) -> None:
        kind = self.spec["kind"]
        if kind == "api":
            url = f"http://{self.host}:{self.port}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    self.addr = url
        elif kind == "ps":
            with contextlib.suppress(OSError, ValueError):
                ready = json.loads(self.ready_file.read_text())
                self.addr = f"{ready['host']}:{ready['port']}"
        else:
            self.addr = self.host
            self.ready.set()
            return
        if self.addr is not None:
            self.ready.set()
            self._note(f"serving at {self.addr}")

    def _resolve(self, wait: bool) -> dict[str, Any] | None:
        """The dependencies' addresses from their actors. wait: until every API replica (after
        ALL_API_S, at least one) and the PS answer (None once stopping); else what answers
        within a second."""
        since = time.monotonic()
        while True:
            api = [a for a in (self._lookup(n, 5.0 if wait else 1.0) for n in self.spec["api"]) if a]
            ps = self._lookup(self.spec["ps"], 5.0 if wait else 1.0) if self.spec["ps"] else None
            # Starting with every replica spares a restart when a late one appears.
            enough = len(api) == len(self.spec["api"]) or (api and time.monotonic() - since > ALL_API_S)
            if not wait or (enough and (ps or not self.spec["ps"])):
                return {"api": sorted(api), "ps": ps}
            if self.stopping.wait(1.0):
                return None

    def _lookup(self, name: str, timeout: float) -> str | None:
        try:
            actor = ray.get_actor(name, namespace=self.spec["namespace"])
            ref: Any = actor.address.remote(timeout)
            return cast("str | None", ray.get(ref, timeout=timeout + 5))
        except (ValueError, ray.exceptions.RayError):
            return None  # not created yet, restarting, or gone

    def _terminate(self, proc: subprocess.Popen, timeout: float) -> int | None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        return proc.returncode
