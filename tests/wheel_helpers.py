"""Building the wheel from the checkout and clean virtualenvs to install it into (no checkout,
no dev environment on sys.path): tests/e2e/test_wheel.py and test_worker_install.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
PACKAGES = ("api", "staleflow_cli", "staleflow_db", "workers")
# What the build reads; copied so that setuptools' build/ and *.egg-info stay out of the checkout.
BUILD_INPUTS = ("pyproject.toml", "README.md", "migrations", *PACKAGES)
TORCH = "torch==2.13.0"


def run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert out.returncode == 0, f"{cmd}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def build_wheel(tmp: Path) -> Path:
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
    run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(src)],
        timeout=300,
    )
    (wheel,) = (tmp / "dist").glob("staleflow-*.whl")
    return wheel


def clean_venv(env_dir: Path, **env_vars: str) -> tuple[Path, dict[str, str]]:
    """A virtualenv without system site-packages; its bin folder and an environment for its
    commands: first on PATH, and nothing of the checkout or the dev environment on sys.path,
    for pip too (a PYTHONPATH with the checkout, and a stray staleflow.egg-info there, makes
    pip skip the wheel)."""
    venv.create(env_dir, with_pip=True)
    bin_dir = env_dir / "bin"
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"}}
    env |= {"PATH": f"{bin_dir}{os.pathsep}{env['PATH']}", **env_vars}
    return bin_dir, env


def pip_install(bin_dir: Path, *requirements: str, cwd: Path, env: dict[str, str]) -> None:
    run(
        [str(bin_dir / "python"), "-m", "pip", "install", "--progress-bar", "off", *requirements],
        timeout=900,
        cwd=cwd,
        env=env,
    )
