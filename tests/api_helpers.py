"""Helpers for the API tests: a real `staleflow serve` subprocess on a free port, tokens, an
in-process app behind starlette's TestClient (an httpx client), and a full protocol walk."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from api.auth import create_token
from api.settings import ApiSettings
from staleflow_cli.launch import free_port
from staleflow_db.db import make_engine
from staleflow_db.settings import Settings
from workers.client import StaleFlowClient
from workers.rollout.worker import RolloutWorker

with warnings.catch_warnings():  # starlette nags about httpx; it is what the client uses
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

REPO = Path(__file__).resolve().parent.parent
ROLES = ("admin", "rollout", "reward", "trainer", "coordinator", "observer")


class ApiServer:
    """`python -m staleflow_cli.main serve` against `db_url` (None: the embedded default under
    STALEFLOW_HOME, migrated by `serve` itself), as its own process."""

    def __init__(self, db_url: str | None, **env: str):
        self.db_url, self.port = db_url, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {k: v for k, v in os.environ.items() if k != "STALEFLOW_DATABASE_URL"}
        self.env.update(env)
        if db_url is not None:
            self.env["STALEFLOW_DATABASE_URL"] = db_url
        fd, name = tempfile.mkstemp(prefix="sf-api-", suffix=".log")
        os.close(fd)
        self.log = Path(name)
        self.proc: subprocess.Popen | None = None

    def launch(self) -> ApiServer:
        # The server writes its own descriptor of the log; ours is closed at once, so no file
        # object here can be flushed or written after closing, across stop/start/relaunch.
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "staleflow_cli.main",
                    "serve",
                    "--port",
                    str(self.port),
                    *(["--no-upgrade"] if self.db_url else []),
                ],
                cwd=REPO,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self

    def start(self, timeout: float = 90.0) -> ApiServer:
        """Launch (unless launched) and wait until it answers (generously: on a busy 2-core
        machine a first start migrates the database before it listens)."""
        if self.proc is None:
            self.launch()
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        relaunches = 3
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                # The free port was taken between our probe and uvicorn's bind (parallel tests).
                if "address already in use" in self.output() and relaunches:
                    relaunches -= 1
                    self.port = free_port()
                    self.url = f"http://127.0.0.1:{self.port}"
                    self.log.write_bytes(b"")
                    self.launch()
                    continue
                raise RuntimeError(f"API server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"API server did not come up in {timeout}s:\n{self.output()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def output(self) -> str:
        """The server's log so far (also after stop(): start-up failures quote it)."""
        try:
            return self.log.read_text(errors="replace")[-5000:]
        except FileNotFoundError:
            return "(no log)"

    def client(self, token: str | None, **kw: Any) -> StaleFlowClient:
        return StaleFlowClient(self.url, token, **kw)

    def __enter__(self) -> ApiServer:
        return self.start()

    def close(self) -> None:
        """Stop the server and delete its log."""
        self.stop()
        self.log.unlink(missing_ok=True)

    def __exit__(self, *exc: Any) -> None:
        self.close()


def token(db_url: str, role: str, run_id: int | None = None) -> str:
    engine = make_engine(db_url)
    try:
        return create_token(engine, role, run_id)["token"]
    finally:
        engine.dispose()


def app_settings(db_url: str, **kw: Any) -> ApiSettings:
    return ApiSettings(db=Settings(database_url=db_url), **kw)


@contextmanager
def in_process(db_url: str, **settings: Any) -> Iterator[TestClient]:
    """The app in this process (lifespan included) behind a synchronous httpx client."""
    from api.app import create_app

    with TestClient(create_app(app_settings(db_url, **settings)), raise_server_exceptions=False) as http:
        yield http


def segment(work: Any, tokens: list[int], logprobs: list[float], kind: str | None = None) -> dict[str, Any]:
    """A report's item for delivered `work` (a finished segment unless `kind` says otherwise)."""
    item = {
        "sample_id": work.sample_id,
        "attempt": work.attempt,
        "route_token": work.route_token,
        "version": 0,
        "tokens": tokens,
        "logprobs": logprobs,
    }
    return item | ({"kind": kind} if kind else {})


def walk_lifecycle(
    admin: StaleFlowClient,
    roles: dict[str, StaleFlowClient],
    run_id: int,
    batch_source: Any = None,
) -> dict[str, Any]:
    """Drive one full step through the API: enqueue -> register -> route -> segments (a partial,
    an interrupt and a continuation) -> rewards -> occupy -> consume -> publish.
    `batch_source()` replaces the trainer's own consume (e.g. a long-poll already waiting)."""
    rollout, reward, trainer, coord = roles["rollout"], roles["reward"], roles["trainer"], roles["coordinator"]
    status = admin.run_status(run_id)
    B, N = status.config.batch_size, status.config.group_size
    trainer.enqueue(run_id, [(f"p{i}", [1, 2, 3 + i]) for i in range(B)])
    inst = rollout.register(run_id, "gpu0", 0).instance_id
    rollout.heartbeat(
        run_id,
        inst,
        0,
        {"running": 0, "waiting": 0, "kv_used": 0, "capacity": {"max_running": 64, "kv_capacity": 4096}},
    )
    queued = [q.sample_id for q in coord.snapshot(run_id).queued]
    results = coord.route(run_id, [(s, inst) for s in queued])
    assert all(r.outcome == "routed" for r in results), results
    work = rollout.poll(run_id, inst, wait=5).work
    assert sorted(w.sample_id for w in work) == sorted(queued)
    first = work[0]
    # A partial checkpoint, then an interrupt: the sample returns to the queue with its tokens.
    rollout.report(
        run_id,
        inst,
        [segment(first, [7], [-0.5], "partial")],
    )
    assert coord.interrupt(run_id, [first.sample_id]) == 1
    cmds = rollout.poll(run_id, inst, wait=5).commands
    assert [(c.kind, c.sample_id) for c in cmds] == [("interrupt", first.sample_id)]
    rollout.report(
        run_id,
        inst,
        [segment(first, [8], [-0.25], "interrupted")],
    )
    (again,) = coord.route(run_id, [(first.sample_id, inst)])
    (cont,) = rollout.poll(run_id, inst, wait=5).work
    assert cont.prefix_tokens == [7, 8] and cont.attempt == again.attempt
    finished = [w for w in work if w.sample_id != first.sample_id] + [cont]
    rollout.report(
        run_id,
        inst,
        [segment(w, [9, 10], [-0.1, -0.2]) for w in finished],
    )
    tasks = reward.claim(run_id, limit=100, wait=5)
    assert len(tasks) == B * N
    outcomes = reward.record_rewards(run_id, [(t.sample_id, t.reward_attempt, float(t.sample_id % 2)) for t in tasks])
    assert {o.state for o in outcomes} == {"occupied"} and len(outcomes) == B
    batch = batch_source() if batch_source else trainer.consume(run_id, 0, wait=5)
    assert batch is not None and len(batch.groups) == B
    new = trainer.publish(run_id, 0, batch.consume_fence, size_bytes=123, checksum="sha256:0", location="ps://0")
    rollout.deregister(run_id, inst)
    return {"instance": inst, "batch": batch, "version": new, "continued": cont}


class TickCountingWorker(RolloutWorker):
    """A rollout worker that counts its loop's ticks: an idle one must wait, not spin."""

    ticks = 0

    def tick(self, inbox: Any) -> None:
        self.ticks += 1
        super().tick(inbox)
