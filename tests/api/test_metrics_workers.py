"""/metrics under `staleflow serve --workers 2`: a scrape answered by either worker counts the
requests of both (prometheus_client's multiprocess mode, in a private directory that serve
creates and removes), reads the database figures once, and forgets the live gauges of worker
processes that are gone (exited, or killed without a chance to say so)."""

from __future__ import annotations

import fnmatch
import glob
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from api import metrics
from tests.api_helpers import REPO, ApiServer, token

ROUTE = "/readyz"  # not /healthz: ApiServer.start polls that an unknown number of times
BATCH = 16
MAX_BATCHES = 20  # guards against a kernel that hands every connection to one worker
WAIT_S = 30  # guards against a hang, never a timing assertion


def samples(body: str, name: str, **labels: str) -> list[float]:
    return [
        s.value
        for f in text_string_to_metric_families(body)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def served_per_process(path: Path) -> dict[str, float]:
    """GET ROUTE count in each worker's own file (pid -> count)."""
    counts = {}
    for f in path.glob("histogram_*.db"):
        if f.stat().st_size == 0:
            continue  # a worker is creating it (prometheus_client sizes it just after): no values yet
        found = [
            s.value
            for m in MultiProcessCollector.merge([str(f)])
            for s in m.samples
            if s.name == "staleflow_api_request_seconds_count" and s.labels.get("route") == ROUTE
        ]
        counts[f.stem.split("_")[1]] = sum(found)
    return counts


def settled(path: Path, sent: int) -> dict[str, float]:
    """Per-process counts once all `sent` are recorded (a worker counts a request just after
    its response went out, so the client can be a moment ahead)."""
    deadline = time.monotonic() + WAIT_S
    while sum((counts := served_per_process(path)).values()) < sent and time.monotonic() < deadline:
        time.sleep(0.05)
    return counts


def alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    return True


def both_workers_up(path: Path) -> None:
    """Wait until two live workers have built their app (each one's outage counter has a file
    from then on); ApiServer.start returns as soon as the first one answers."""
    deadline = time.monotonic() + WAIT_S * 3
    while len({pid for f in path.glob("counter_*.db") if alive(pid := f.stem.split("_")[1])}) < 2:
        assert time.monotonic() < deadline, f"two workers never came up: {sorted(os.listdir(path))}"
        time.sleep(0.1)


def _get(url: str) -> int:
    return httpx.get(url, timeout=30).status_code  # a new connection each: the kernel picks the worker


@pytest.mark.slow
def test_two_workers_scrape_the_sum_and_the_database_once(db_url, tmp_path):
    # TMPDIR: serve's private directory lands where the test can look at (and after) it
    with ApiServer(db_url, STALEFLOW_API_WORKERS="2", TMPDIR=str(tmp_path)) as server:
        (metrics_dir,) = tmp_path.glob("staleflow-metrics-*")
        both_workers_up(metrics_dir)
        admin = server.client(token(db_url, "admin"))
        run = str(admin.create_run("workers", batch_size=2, group_size=1, eta=1).id)
        admin.enqueue(int(run), [(f"p{i}", [1, 2, 3]) for i in range(3)])
        sent = 0
        with ThreadPoolExecutor(8) as pool:
            for _ in range(MAX_BATCHES):
                assert set(pool.map(_get, [server.url + ROUTE] * BATCH)) == {200}
                sent += BATCH
                per_process = settled(metrics_dir, sent)
                if sum(n > 0 for n in per_process.values()) == 2:
                    break
        assert sum(n > 0 for n in per_process.values()) == 2, f"one worker served all: {per_process}\n{server.output()}"
        assert sum(per_process.values()) == sent

        # Files as a process that is creating them leaves them for an instant (empty, not yet
        # sized): a scrape must skip them, not fail on them (CI saw the test's own reader do so).
        for kind in ("histogram", "counter", "gauge_livesum"):
            (metrics_dir / f"{kind}_{os.getpid()}.db").touch()
        for _ in range(6):  # each scrape may reach either worker: every one sees the total
            scrape = httpx.get(server.url + "/metrics", timeout=30)
            assert scrape.status_code == 200, f"{scrape.text}\n{server.output()}"
            body = scrape.text
            assert samples(body, "staleflow_api_request_seconds_count", method="GET", route=ROUTE) == [sent]
            # the database figures once, not once per worker
            assert samples(body, "staleflow_database_up") == [1]
            assert samples(body, "staleflow_run_version", run=run) == [0]
            assert samples(body, "staleflow_queued_samples", run=run, level="new") == [3]
            assert samples(body, "staleflow_protocol_transaction_seconds_count", operation="enqueue") == [1]
            (cpu,) = samples(body, "staleflow_protocol_transaction_cpu_seconds_total", operation="enqueue")
            assert cpu > 0
    assert not metrics_dir.exists()  # removed when serve exits


WAITER = """
import sys, time
from api.metrics import Metrics

def no_database():
    raise RuntimeError("no database here")

metrics = Metrics(no_database)
with metrics.waiting(sys.argv[1]):
    print("waiting", flush=True)
    if sys.argv[2] == "hold":
        time.sleep(600)
"""
SCRAPE = "import sys; from api.metrics import Metrics; sys.stdout.write(Metrics(lambda: 1 / 0).exposition().decode())"


def test_live_gauges_of_gone_processes_disappear(tmp_path):
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}

    def python(*args: str, **kw) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-c", *args], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True, **kw
        )

    def waiters(topic: str) -> float:
        out = subprocess.run([sys.executable, "-c", SCRAPE], cwd=REPO, env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return sum(samples(out.stdout, "staleflow_long_poll_waiters", topic=topic))

    holder = python(WAITER, "work:7", "hold")
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "waiting\n"
        leaver = python(WAITER, "batch", "exit")
        assert leaver.communicate(timeout=60)[0] == "waiting\n" and leaver.returncode == 0
        assert waiters("work") == 1
        assert waiters("batch") == 0
        assert not (tmp_path / f"gauge_livesum_{leaver.pid}.db").exists()  # its atexit hook
        holder.kill()  # no atexit: the next scrape notices the pid is gone
        holder.wait(60)
        assert (tmp_path / f"gauge_livesum_{holder.pid}.db").exists()
        assert waiters("work") == 0
        assert not (tmp_path / f"gauge_livesum_{holder.pid}.db").exists()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_a_dead_processs_gauges_removed_by_another_scrape_meanwhile(tmp_path, monkeypatch):
    """Two scrapes at once (two Prometheus servers) each forget a dead worker: both list its live
    gauge files, one removes them, and the other must not fail on the files it listed (a 500).
    The listing is made stale here, as the other scrape would make it."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(60)
    gone = tmp_path / f"gauge_livesum_{dead.pid}.db"
    kept = tmp_path / f"gauge_livemax_{dead.pid}.db"
    kept.touch()
    listing = glob.glob

    def stale(pattern: str, **kw) -> list[str]:
        return sorted({*listing(pattern, **kw), *fnmatch.filter([str(gone)], pattern)})

    monkeypatch.setattr(glob, "glob", stale)
    metrics._forget_dead_processes(str(tmp_path))
    assert not kept.exists()


LIFESPAN = """
import os, sys
from tests.api_helpers import in_process

gauge = os.path.join(os.environ["PROMETHEUS_MULTIPROC_DIR"], f"gauge_livesum_{os.getpid()}.db")
with in_process(sys.argv[1]) as http:
    with http.app.state.staleflow.metrics.waiting("work"):
        pass
    print(os.path.exists(gauge))
print(os.path.exists(gauge), flush=True)
"""


def test_the_end_of_the_lifespan_drops_live_gauges(db_url, tmp_path):
    # What a uvicorn worker does on SIGTERM: lifespan shutdown, then death by the re-raised
    # signal (no atexit), so the lifespan is where its live gauges leave the sum.
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", LIFESPAN, db_url], cwd=REPO, env=env, capture_output=True, text=True, timeout=WAIT_S * 4
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"]
