"""A small `staleflow demo` as a new user runs it: every process real, the audit clean, a report."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import httpx
import pytest

pytest.importorskip("torch")


def _open_dashboard_while_running(proc: subprocess.Popen) -> tuple[list[str], httpx.Response]:
    """Read the demo's output up to its dashboard link and open the link while the run goes on."""
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        found = re.search(r"dashboard: (http://\S+/ui/login\?token=\S+&next=/ui/runs/(\d+))", line)
        if found:
            with httpx.Client(timeout=30) as http:
                page = http.get(found.group(1), follow_redirects=True)
            return lines, page
    raise AssertionError("no dashboard link in the output:\n" + "".join(lines)[-3000:])


TEXT = {"capture_output": True, "text": True, "timeout": 300}


@pytest.mark.slow  # a whole demo run, every role as a process
def test_small_demo_trains_publishes_and_reports(db_url, tmp_path):
    env = {**os.environ, "STALEFLOW_DATABASE_URL": db_url}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "staleflow_cli.main",
            "demo",
            "--steps",
            "3",
            "--instances",
            "2",
            "--batch-size",
            "4",
            "--group-size",
            "2",
            "--report-dir",
            str(tmp_path),
            "--timeout",
            "240",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        head, page = _open_dashboard_while_running(proc)
        rest, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    stdout = "".join(head) + rest
    assert proc.returncode == 0, stdout[-5000:]
    # The link signs the browser in with the demo's observer token and lands on the run's page.
    assert page.status_code == 200, page.text[:500]
    assert page.url.path.startswith("/ui/runs/") and "demo-" in page.text
    assert "staleness_violations: 0" in stdout
    last = stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"demo steps=3 accuracy=[01]\.\d{3} reward=-?\d\.\d{3} max_reward=1\.200 violations=0", last), (
        last
    )
    (folder,) = tmp_path.iterdir()
    report = json.loads((folder / "report.json").read_text())
    assert [s["step"] for s in report["steps"]] == [0, 1, 2]
    assert all(s["samples"] == 8 for s in report["steps"])  # B * N per step
    assert all(0.0 <= s["accuracy"] <= 1.0 for s in report["steps"])
    assert report["audit"]["violations"] == []
    assert (folder / "demo.png").stat().st_size > 10_000
    # The static dashboard: the run's panels with their data inlined, no service needed.
    index = (folder / "index.html").read_text()
    assert report["name"] in index and "http://" not in index.split("</head>")[0]
    assert {p.name for p in (folder / "logs").iterdir()} >= {"api.log", "trainer.log", "coordinator.log", "ps.log"}
    # Replay on the demo: step 1 rebuilt from the run's export and trained again from the kept
    # checkpoint gives the loss the trainer logged and the weights it published as version 2.
    cli = [sys.executable, "-m", "staleflow_cli.main"]
    export = tmp_path / "export"
    done = subprocess.run([*cli, "export", report["name"], "--out", str(export), "--trained"], env=env, **TEXT)
    assert done.returncode == 0, done.stdout + done.stderr
    ckpt = folder / "checkpoint" / "versions" / "v1.pt"
    done = subprocess.run(
        [*cli, "replay", str(export), "--step", "1", "--checkpoint", str(ckpt)], env={**env, "COLUMNS": "200"}, **TEXT
    )
    assert done.returncode == 0, done.stdout + done.stderr  # 1: the losses differ beyond the tolerance
    assert re.search(r"step 1: 8 samples, loss \S+ logged \S+ diff .* same as v2's", done.stdout), done.stdout


def test_staleness_experiment_writes_table_json_and_plot(tmp_path):
    """The experiment's outputs from run records (the runs themselves are demos, tested above)."""
    from staleflow_cli.demo import DemoConfig
    from staleflow_cli.experiment import write

    runs = [
        {
            "eta": eta,
            "tis": tis,
            "seed": seed,
            "final_accuracy": 0.5 + 0.1 * seed,
            "final_reward": 1.0,
            "samples_per_s": 20.0,
            "reward": [0.0, 0.5, 1.0],
            "accuracy": [0.0, 0.2, 0.5],
        }
        for eta in (0, 2)
        for tis in (True, False)
        for seed in (0, 1)
    ]
    write(runs, DemoConfig(steps=3), tmp_path)
    md = (tmp_path / "staleness.md").read_text()
    assert "| 0 | on | 2 | 0.550 ± 0.071 | 1.000 ± 0.000 | 20.000 ± 0.000 |" in md
    assert len(json.loads((tmp_path / "staleness.json").read_text())["runs"]) == 8
    assert (tmp_path / "staleness.png").stat().st_size > 10_000


def test_staleness_append_runs_only_what_is_missing(tmp_path):
    """`--append` over a result that already holds every asked configuration runs no demo (it
    would start processes) and keeps the runs as they were: re-running completes, never repeats."""
    from typer.testing import CliRunner

    from staleflow_cli.demo import DemoConfig
    from staleflow_cli.experiment import app, write

    runs = [
        {"eta": 2, "tis": True, "seed": seed, "final_accuracy": 0.5, "final_reward": 1.0, "samples_per_s": 20.0}
        | {"reward": [0.0, 1.0], "accuracy": [0.0, 0.5]}
        for seed in (0, 1)
    ]
    write(runs, DemoConfig(steps=2), tmp_path)
    before = (tmp_path / "staleness.json").read_text()
    args = ["staleness", "--etas", "2", "--seeds", "2", "--tis", "on", "--append", "--out", str(tmp_path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.output.count("already in") == 2 and "failed" not in result.output
    assert (tmp_path / "staleness.json").read_text() == before
