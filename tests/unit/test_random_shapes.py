"""Random workload shapes (workers/sim/shape_draws.py) and their bench (bench/random_shapes.py)."""

import json
import re

from workers.sim.setups import CLUSTER_GPUS, PAPER_SETUPS
from workers.sim.shape_draws import describe, random_setup


def test_a_shape_is_the_same_draw_on_every_call():
    assert random_setup(7) == random_setup(7)
    assert random_setup(7) != random_setup(8)
    assert random_setup(7).name.startswith("random_7_")


def test_the_draws_span_the_models_and_both_trainer_sizes_and_fit_the_cluster():
    shapes = [random_setup(k) for k in range(64)]
    assert {s.model for s in shapes} == set(PAPER_SETUPS)
    assert any(s.trainer_gpus + s.rollout_gpus == CLUSTER_GPUS for s in shapes)  # the rest of the cluster
    assert any(s.trainer_gpus + s.rollout_gpus < CLUSTER_GPUS for s in shapes)  # a small trainer
    for s in shapes:
        assert s.rollout_gpus + s.trainer_gpus <= CLUSTER_GPUS
        assert s.workload.max_response == s.max_response
        assert s.model in describe(s)


def test_the_quick_bench_writes_its_tables_and_prints_its_summary_last(tmp_path, capsys):
    from bench.random_shapes import main

    main(["--quick", "--out", str(tmp_path), "--jobs", "1"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.fullmatch(r"random_shapes cells=(\d+) below_strict=(\d+) min_strict=([\d.]+) mean_strict=([\d.]+)", last)
    assert m, last
    data = json.loads((tmp_path / "random_shapes.json").read_text())
    assert int(m.group(1)) == len(data["cells"]) == 2
    runs = {(r["shape"], r["policy"], r["eta"]): r["steady_tokens_per_s"] for r in data["runs"]}
    for c in data["cells"]:
        # a cell's ratio is staleflow's tokens/s over strict's on the same shape, η and seed
        assert c["ratio"] == runs[(c["shape"], "staleflow", c["eta"])] / runs[(c["shape"], "strict", c["eta"])]
    assert int(m.group(2)) == sum(c["ratio"] < 1.0 for c in data["cells"])
    assert last in (tmp_path / "random_shapes.md").read_text()


def test_bad_arguments_exit_with_a_message_and_write_nothing(tmp_path, capsys):
    import pytest

    from bench.random_shapes import main

    for args in (["--cells", "39"], ["--shapes", "a-b"], ["--etas", "0"], ["--shapes", "-3"]):
        with pytest.raises(SystemExit) as e:
            main([*args, "--out", str(tmp_path)])
        assert e.value.code == 2
        assert "error:" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
