"""The wheel as a user gets it: built from the checkout, installed into a clean virtualenv,
run from another folder -- so a migration, package or data file that only a checkout
has fails here rather than after a release.

Minutes (a virtualenv with torch): marked `slow`, so `make test` leaves it to `make test-all`,
and `wheel`, so .ci/run's pass against the PostgreSQL server (`-m "db and not wheel ..."`)
does not run it again.
"""

from __future__ import annotations

import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from wheel_helpers import CHECKOUT, PACKAGES, TORCH, build_wheel, clean_venv, pip_install, run

from staleflow_db.db import with_database

# Past pytest-timeout's default: two pip installs (torch) and a demo.
pytestmark = [pytest.mark.slow, pytest.mark.wheel, pytest.mark.timeout(1800)]


def _expected_files() -> set[str]:
    """Every module and data file of the checkout's packages, as wheel paths."""
    files = {
        str(p.relative_to(CHECKOUT))
        for pkg in PACKAGES
        for p in (CHECKOUT / pkg).rglob("*")
        if p.suffix in {".py", ".sql", ".json"} and "__pycache__" not in p.parts
    }
    files |= {f"staleflow_db/{p.relative_to(CHECKOUT)}" for p in (CHECKOUT / "migrations").rglob("*.py")}
    return files


@pytest.fixture
def empty_db(admin_url: str) -> Iterator[str]:
    name = f"sf_wheel_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    yield with_database(admin_url, name)
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def test_wheel_installs_migrates_and_runs_the_demo(tmp_path: Path, empty_db: str) -> None:
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        missing = _expected_files() - set(z.namelist())
    assert not missing, f"not in the wheel (a package missing from pyproject's list?): {sorted(missing)}"

    env_dir = tmp_path / "venv"
    bin_dir, env = clean_venv(env_dir, STALEFLOW_HOME=str(tmp_path / "home"), STALEFLOW_DATABASE_URL=empty_db)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    pip_install(bin_dir, TORCH, cwd=elsewhere, env=env)  # first, as the README says
    pip_install(bin_dir, f"{wheel}[demo]", cwd=elsewhere, env=env)
    staleflow = str(bin_dir / "staleflow")

    where = run(
        [str(bin_dir / "python"), "-c", "import staleflow_db; print(staleflow_db.__file__)"],
        timeout=60,
        cwd=elsewhere,
        env=env,
    )
    assert str(env_dir) in where.stdout, f"staleflow_db imported from {where.stdout}, not the installed wheel"

    up = run([staleflow, "db", "upgrade"], timeout=300, cwd=elsewhere, env=env)
    assert "upgraded (empty) ->" in up.stdout, up.stdout + up.stderr

    demo = run(
        [
            staleflow,
            "demo",
            "--steps",
            "2",
            "--instances",
            "1",
            "--batch-size",
            "2",
            "--group-size",
            "2",
            "--report-dir",
            str(tmp_path / "reports"),
            "--timeout",
            "240",
        ],
        timeout=300,
        cwd=elsewhere,
        env=env,
    )
    assert "staleness_violations: 0" in demo.stdout, demo.stdout[-3000:]
