"""A missing optional dependency is named with the extra that brings it, before any work."""

from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner

from staleflow_cli.main import app
from workers.extras import MissingExtra, require

runner = CliRunner()


def test_require_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(MissingExtra, match=r"pip install 'staleflow\[plots\]'"):
        require("matplotlib")
    assert require("json").dumps(1) == "1"


def test_commands_needing_an_extra_say_which(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    res = runner.invoke(app, ["ps", "--run", "1", "--data-dir", str(tmp_path)])
    assert res.exit_code == 1 and "staleflow[torch]" in res.output, res.output
    res = runner.invoke(app, ["sim", "bench", "--setups", "tiny", "--out", str(tmp_path)])
    assert res.exit_code == 1 and "staleflow[plots]" in res.output, res.output
    assert not list(tmp_path.iterdir())  # refused before running anything
    res = runner.invoke(app, ["demo", "--steps", "1"])
    assert res.exit_code == 1 and "staleflow[torch]" in res.output, res.output
