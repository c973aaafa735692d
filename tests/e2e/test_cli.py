"""The `staleflow` command as a real subprocess."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from staleflow_db import migrate
from staleflow_db.embedded import EmbeddedPostgres


def staleflow(*args: str, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess:
    # The installed console script when there is one (pip install -e .), else the module.
    exe = Path(sys.executable).parent / "staleflow"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "staleflow_cli.main"]
    proc = subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=120)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "STALEFLOW_DATABASE_URL"}
    env.update(extra)
    return env


def test_console_script_is_installed() -> None:
    if os.environ.get("CI") != "true" and shutil.which("staleflow") is None:
        pytest.skip("not installed (pip install -e .)")
    assert (Path(sys.executable).parent / "staleflow").exists()


@pytest.mark.embedded
@pytest.mark.slow
def test_db_commands_on_embedded_server(embedded_pg: EmbeddedPostgres) -> None:
    env = _env(STALEFLOW_HOME=str(embedded_pg.home))

    out = staleflow("db", "status", env=env).stdout
    assert "running:   no" in out and not embedded_pg.is_running()  # status starts nothing

    url = staleflow("db", "url", env=env).stdout.strip()
    assert url == embedded_pg.url()  # and the server outlived the command
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)

    head = migrate.head()
    out = staleflow("db", "upgrade", env=env).stdout
    if head is not None:
        assert f"-> {head}" in out
        assert f"already at {head}" in staleflow("db", "upgrade", env=env).stdout
        assert "(up to date)" in staleflow("db", "status", env=env).stdout

    assert "stopped" in staleflow("db", "stop", env=env).stdout
    assert not embedded_pg.is_running()
    assert "was not running" in staleflow("db", "stop", env=env).stdout


def test_db_commands_with_database_url(db_url: str) -> None:
    env = _env(STALEFLOW_DATABASE_URL=db_url)
    assert staleflow("db", "url", env=env).stdout.strip() == db_url
    out = staleflow("db", "status", env=env).stdout
    assert "STALEFLOW_DATABASE_URL" in out
    head = migrate.head()
    if head is not None:
        assert f"already at {head}" in staleflow("db", "upgrade", env=env).stdout


def test_status_reports_unreachable_server() -> None:
    env = _env(STALEFLOW_DATABASE_URL="postgresql://postgres@127.0.0.1:1/nope")
    proc = staleflow("db", "status", env=env, check=False)
    assert proc.returncode == 1 and "unreachable" in proc.stdout
