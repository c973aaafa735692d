"""docs/integration.md's walk, run as written: its ```bash walk blocks, in order, in one bash
in an empty folder, on the embedded database of a fresh STALEFLOW_HOME (no
STALEFLOW_DATABASE_URL). The walk creates a run, enqueues its JSON Lines, starts the user's
reward function and environment in workers, trains 4 steps, audits and stops everything; the
test checks the audit's verdict, the trained steps, the dashboard page while the API is up,
and that the walk's last block left no process of its own behind."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from staleflow_db.embedded import EmbeddedPostgres

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "integration.md"
BLOCK = re.compile(r"^```bash walk\n(.*?)^```$", re.DOTALL | re.MULTILINE)
WALK_S = 600  # guards against a hang, never a timing assertion

# Inserted before the walk's last block (which stops the API): open the dashboard link the
# walk printed, as a browser would (the login sets a cookie and redirects to the run's page).
DASHBOARD_CHECK = """
LINK=$(grep -o 'http://[^ ]*/ui/login?[^ ]*' walk.out)
curl -sf -L -c ui.cookies -b ui.cookies "$LINK" > ui.html
"""

pytestmark = [pytest.mark.slow, pytest.mark.embedded]


def walk_blocks() -> list[str]:
    return BLOCK.findall(DOC.read_text())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_walk_has_its_steps_in_order():
    text = "\n".join(walk_blocks())
    order = [
        "staleflow serve",
        "staleflow run create my-run",
        "staleflow enqueue my-run",
        "--reward my_reward:score",
        "--env my_env:TwoTries",
        "staleflow coordinator",
        "staleflow ps",
        "/ui/",
        "staleflow trainer",
        "staleflow audit my-run",
        "staleflow db stop",
    ]
    at = [text.find(s) for s in order]
    assert -1 not in at, dict(zip(order, at))
    assert at == sorted(at), dict(zip(order, at))


@pytest.mark.skipif(shutil.which("curl") is None, reason="the walk waits for the API with curl")
def test_the_integration_walk_runs_as_written(tmp_path):
    blocks = walk_blocks()
    # `bash -e` stops at the first failing command up to the last block; that one stops
    # processes, whose status is SIGTERM's (143), as a user's shell (without -e) sees it.
    script = "\n".join([*blocks[:-1], DASHBOARD_CHECK, "set +e", blocks[-1]])
    work = tmp_path / "walk"
    work.mkdir()
    home = tmp_path / "home"
    api_port, ps_port = _free_port(), _free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("STALEFLOW_DATABASE_URL", "STALEFLOW_TOKEN", "STALEFLOW_API_URL")
    }
    env.update(
        STALEFLOW_HOME=str(home),
        # The walk's defaults are 8000 and 8790; other tests may be using those here.
        STALEFLOW_API_PORT=str(api_port),
        STALEFLOW_API_URL=f"http://127.0.0.1:{api_port}",
        PS_PORT=str(ps_port),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p),
        COLUMNS="200",
    )
    out = work / "walk.out"
    try:
        with out.open("w") as sink:
            proc = subprocess.Popen(
                ["bash", "-e", "-c", script],
                cwd=work,
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                rc = proc.wait(timeout=WALK_S)
            finally:
                leftover = _kill_group(proc.pid)
        text = out.read_text()
        logs = "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(work.glob("*.log")))
        assert rc == 0, text + logs
        assert "created run 1 (my-run)" in text, text
        assert "enqueued 16 prompts from prompts.jsonl into run 1 (16 new" in text, text
        assert "trainer: 4 step(s) published; run 1 at version 4" in text, text + logs
        assert "staleness_violations: none" in text, text
        # Every step trained B x N = 8 samples (the audit's per-step table: step, samples, ...).
        for step in range(4):
            assert re.search(rf"│\s+{step} │\s+8 │", text), text
        page = (work / "ui.html").read_text()
        assert "my-run" in page, page[:2000]
        assert "reward worker: " in (work / "reward.log").read_text()
        assert not leftover, f"the walk's last block left processes running: {leftover}\n{text}{logs}"
        assert not EmbeddedPostgres(home).is_running(), "`staleflow db stop` left the embedded server running"
    finally:
        EmbeddedPostgres(home).stop()


def _kill_group(pgid: int) -> list[str]:
    """Kill what is left of the walk's process group; the command lines of what was left."""
    found = subprocess.run(["ps", "-o", "pid=,args=", "--sid", str(pgid)], capture_output=True, text=True).stdout
    left = [line.strip() for line in found.splitlines() if line.strip()]
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return left
