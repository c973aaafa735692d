"""A stopping API server answers its open long-polls instead of holding them: over real HTTP,
SIGTERM to `staleflow serve` while an instance's long-poll waits gives that poll its (empty)
answer, ends the dashboard's event stream, and the server exits cleanly (api/draining.py).
Without it the poll was held until uvicorn's graceful-shutdown timeout and then cut (a 500)."""

from __future__ import annotations

import re
import signal
import threading
import time
from typing import Any

import httpx

from tests.api_helpers import ApiServer, token
from tests.protocol_helpers import Driver


def _parked(url: str) -> bool:
    body = httpx.get(url + "/metrics", timeout=10).text
    return re.search(r'staleflow_long_poll_waiters\{topic="work"\} [1-9]', body) is not None


def test_sigterm_answers_a_waiting_long_poll_ends_the_stream_and_the_server_exits(db_url, engine):
    d = Driver(engine, batch_size=1, group_size=1, eta=0)
    with ApiServer(db_url) as server:
        client = server.client(token(db_url, "rollout", d.run), timeout=60)
        inst = client.register(d.run, "a", 0, lease_seconds=120).instance_id
        got: dict[str, Any] = {}

        def poll() -> None:
            try:
                got["out"] = client.poll(d.run, inst, wait=30)
            except Exception as exc:  # what the test reports
                got["error"] = exc

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        admin = {"Authorization": f"Bearer {token(db_url, 'admin')}"}
        with httpx.stream("GET", f"{server.url}/v1/runs/{d.run}/dashboard/stream", headers=admin, timeout=60) as s:
            lines = s.iter_lines()
            assert next(lines).startswith("data: {")
            deadline = time.monotonic() + 30
            while not _parked(server.url):
                assert time.monotonic() < deadline, "the long-poll never waited at the server"
                time.sleep(0.1)
            assert server.proc is not None
            server.proc.send_signal(signal.SIGTERM)
            poller.join(25)  # the poll's own wait (30 s) would outlast this
            assert not poller.is_alive() and "error" not in got, got
            assert got["out"].work == [] and got["out"].commands == []
            list(lines)  # the stream ends, without an error
        # exits as uvicorn does on a signal: its shutdown done, it re-raises the signal
        assert server.proc.wait(20) == -signal.SIGTERM
        assert "timeout graceful shutdown exceeded" not in server.output()
        client.close()
