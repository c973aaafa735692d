"""The wheel as a user gets it: built from the checkout, installed into a clean virtualenv,
run from another folder -- so a migration, package or data file that only a checkout
has fails here rather than after a release.

Minutes (a virtualenv with torch): marked `slow`, so `make test` leaves it to `make test-all`,
and `wheel`, so .ci/run's pass against the PostgreSQL server (`-m "db and not wheel ..."`)
does not run it again.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
import venv
import zipfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from staleflow_db.db import with_database

# Past pytest-timeout's default: two pip installs (torch) and a demo.
pytestmark = [pytest.mark.slow, pytest.mark.wheel, pytest.mark.timeout(1800)]

CHECKOUT = Path(__file__).resolve().parents[2]
PACKAGES = ("api", "staleflow_cli", "staleflow_db", "workers")
# What the build reads; copied so that setuptools' build/ and *.egg-info stay out of the checkout.
BUILD_INPUTS = ("pyproject.toml", "README.md", "migrations", *PACKAGES)


def _run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert out.returncode == 0, f"{cmd}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def _build_wheel(tmp: Path) -> Path:
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in BUILD_INPUTS:
        path = CHECKOUT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    # The dev environment's setuptools: no isolated build environment to download.
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(src)],
        timeout=300,
    )
    (wheel,) = (tmp / "dist").glob("staleflow-*.whl")
    return wheel


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
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        missing = _expected_files() - set(z.namelist())
    assert not missing, f"not in the wheel (a package missing from pyproject's list?): {sorted(missing)}"

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)  # clean: no system site-packages
    bin_dir = env_dir / "bin"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # Nothing of the checkout or the dev environment on sys.path, for pip too: a PYTHONPATH
    # with the checkout (and a stray staleflow.egg-info there) makes pip skip the wheel.
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"}}
    env |= {
        "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}",
        "STALEFLOW_HOME": str(tmp_path / "home"),
        "STALEFLOW_DATABASE_URL": empty_db,
    }
    pip = [str(bin_dir / "python"), "-m", "pip", "install", "--progress-bar", "off"]
    _run([*pip, "torch==2.13.0"], timeout=900, cwd=elsewhere, env=env)  # first, as the README says
    _run([*pip, f"{wheel}[demo]"], timeout=900, cwd=elsewhere, env=env)
    staleflow = str(bin_dir / "staleflow")

    where = _run(
        [str(bin_dir / "python"), "-c", "import staleflow_db; print(staleflow_db.__file__)"],
        timeout=60,
        cwd=elsewhere,
        env=env,
    )
    assert str(env_dir) in where.stdout, f"staleflow_db imported from {where.stdout}, not the installed wheel"

    up = _run([staleflow, "db", "upgrade"], timeout=300, cwd=elsewhere, env=env)
    assert "upgraded (empty) ->" in up.stdout, up.stdout + up.stderr

    demo = _run(
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
