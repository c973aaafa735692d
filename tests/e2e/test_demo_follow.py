"""The demo's progress loop against a real run and real processes: a trainer that exits 0 right
after its last publish, before the loop has seen that version, is a finished run, not a failure;
one that exits 0 short of the steps still fails the demo."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from staleflow_cli.demo import DemoConfig, _follow
from staleflow_cli.launch import Cluster, ProcessDied
from tests.protocol_helpers import Driver


def _run_at_version_1(engine) -> Driver:
    d = Driver(engine, batch_size=1, group_size=1, eta=1)
    inst = d.p.register_instance(d.run, "i", 0)
    (g,) = d.enqueue(1)
    d.complete(d.members(g), inst)
    d.train(0)
    return d


def _exited_trainer(tmp_path, db_url) -> Cluster:
    cluster = Cluster(tmp_path, db_url)
    cluster.spawn("trainer", ["--help"]).popen.wait(60)  # exits 0 at once
    return cluster


def test_a_trainer_that_exits_after_its_last_publish_finishes_the_demo(tmp_path, db_url, engine):
    d = _run_at_version_1(engine)
    console = Console(file=io.StringIO())
    _follow(_exited_trainer(tmp_path, db_url), d.p, engine, d.run, DemoConfig(steps=1), console)


def test_a_trainer_that_exits_short_of_the_steps_fails_the_demo(tmp_path, db_url, engine):
    d = _run_at_version_1(engine)
    console = Console(file=io.StringIO())
    with pytest.raises(ProcessDied, match="trainer exited with code 0"):
        _follow(_exited_trainer(tmp_path, db_url), d.p, engine, d.run, DemoConfig(steps=2), console)
