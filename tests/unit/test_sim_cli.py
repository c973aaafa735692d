from typer.testing import CliRunner

from staleflow_cli.sim import app

runner = CliRunner()


def test_sim_run_prints_a_summary():
    res = runner.invoke(app, ["run", "--model", "tiny", "--policy", "staleflow", "--eta", "1", "--steps", "2"])
    assert res.exit_code == 0, res.output
    assert "tiny staleflow eta=1" in res.output and "tok/s" in res.output


def test_sim_run_rejects_an_unknown_policy():
    res = runner.invoke(app, ["run", "--model", "tiny", "--policy", "nope", "--steps", "1"])
    assert res.exit_code != 0


def test_sim_bench_last_line_is_the_summary(tmp_path):
    res = runner.invoke(app, ["bench", "--setups", "tiny", "--steps", "3", "--jobs", "1", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    last = res.output.strip().splitlines()[-1]
    assert last.startswith("staleflow/sync=") and " staleflow/strict=" in last
    assert (tmp_path / "policies.md").exists() and (tmp_path / "policies_throughput.png").exists()
