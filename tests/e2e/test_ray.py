"""`staleflow launch ray` on a real multi-node Ray cluster on this machine (ray.cluster_utils):
a head node for the control plane and two worker nodes, each with its own custom resources.

A `sim` run (B=2, N=2) is launched through the CLI; its roles land where their resources
say (API and coordinators on the head, the trainer and the parameter server co-located by a
placement group, rollout instances spread over the workers). A killed process is restarted by
its actor in place. Mid-run the node holding the
trainer is removed: Ray restarts its actors on the surviving node, the processes find the
API and each other again through the named actors, the run reaches its last step, the
launcher stops everything, and the complete audit is empty.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'staleflow[ray]')")
from ray.cluster_utils import Cluster

from staleflow_db.audit import find_run, violations
from staleflow_db.db import make_engine
from staleflow_db.protocol import Protocol

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]
STEPS = 10
# A removed node is declared dead after ~3 s instead of Ray's default ~30 s.
FAST_FAILURE = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}
NODE = {"num_cpus": 1, "object_store_memory": 80 * 1024**2}
CPU = 0.05  # two cores for the whole machine: the actors mostly wait


def _config(path: Path, address: str, namespace: str, db_url: str, workdir: Path) -> Path:
    role = f"num_cpus = {CPU}\n"
    path.write_text(
        f"""
[ray]
address = "{address}"
namespace = "{namespace}"
workdir = "{workdir}"

[run]
name = "ray-e2e"
steps = {STEPS}
batch_size = 2
group_size = 2
eta = 1
max_response_tokens = 128
max_prompt_tokens = 64
database_url = "{db_url}"

[env]
STALEFLOW_SIM_TIME_SCALE = "0.01"

[api]
replicas = 2
{role}resources = {{ control = 1 }}

[coordinator]
replicas = 2
{role}resources = {{ control = 1 }}
args = ["--lease", "2"]

[ps]
replicas = 1
{role}resources = {{ worker = 1 }}

[trainer]
engine = "sim"
{role}resources = {{ worker = 1 }}
args = ["--sim-overhead", "0.3", "--sim-s-per-token", "0", "--wait", "1"]

[reward]
verifier = "sim"
{role}resources = {{ worker = 1 }}

[rollout]
engine = "sim"
replicas = 2
spread = true
{role}resources = {{ worker = 1 }}
args = ["--heartbeat", "0.25"]

[[placement_groups]]
roles = ["trainer", "ps"]
strategy = "STRICT_PACK"
"""
    )
    return path


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "staleflow_cli.main", *args], cwd=REPO, capture_output=True, text=True, **kw
    )


def _until(cond, what: str, timeout: float, check=lambda: None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        check()
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_config_example_parses_and_bad_ones_are_refused(tmp_path):
    import typer

    from staleflow_cli.launch_ray import _argv, actor_resources, load_config

    cfg = load_config(REPO / "deploy" / "ray" / "run.toml")
    assert (cfg.api.replicas, cfg.coordinator.replicas, cfg.ps.replicas) == (2, 2, 1)
    cfg.rollout.num_gpus, cfg.rollout.tensor_parallel = 1, 4
    assert actor_resources(cfg.rollout)["num_gpus"] == 4  # per instance: GPUs x tensor parallel size
    partial = tmp_path / "partial.toml"  # a section setting other fields keeps the role's replicas
    partial.write_text('[run]\nname = "x"\n[api]\nnum_cpus = 0.5\n[rollout]\nnum_cpus = 0.5')
    assert (load_config(partial).api.replicas, load_config(partial).rollout.replicas) == (2, 2)
    vllm = tmp_path / "vllm.toml"  # TP2: two GPUs per instance, and vLLM told the same
    vllm.write_text(
        '[run]\nname = "x"\n[ps]\nreplicas = 1\n[rollout]\nengine = "vllm"\nnum_gpus = 1\ntensor_parallel = 2\n'
        'args = ["--vllm-model", "Qwen/Qwen2.5-0.5B"]\n'
        '[rollout.engine_args]\ndtype = "bfloat16"\ngpu_memory_utilization = 0.85\nenforce_eager = true\n'
    )
    vcfg = load_config(vllm)
    assert actor_resources(vcfg.rollout)["num_gpus"] == 2
    argv = _argv(vcfg, "rollout", 0, 1, "/tmp")
    pairs = [argv[i + 1] for i, a in enumerate(argv) if a == "--engine-arg"]
    assert pairs == ['dtype="bfloat16"', "gpu_memory_utilization=0.85", "enforce_eager=true", "tensor_parallel_size=2"]
    bad = tmp_path / "bad.toml"
    vllm_run = '[run]\nname = "x"\n[ps]\nreplicas = 1\n[rollout]\nengine = "vllm"\n'
    for text, problem in [
        (vllm_run + "[rollout.engine_args]\ntensor_paralel_size = 2", "did you mean 'tensor_parallel_size'"),
        (vllm_run + "tensor_parallel = 2\n[rollout.engine_args]\ntensor_parallel_size = 4", "set them equal"),
        ('[run]\nname = "x"\n[rollout.engine_args]\ndtype = "float16"', "apply to the vllm engine"),
        ('[run]\nname = "x"\n[rollout]\nengine = "torch"', "parameter server"),
        ('[run]\nname = "x"\n[[placement_groups]]\nroles = ["trainr"]', "unknown role"),
        ('[run]\nname = "x"\n[api]\nreplica = 2', "replica"),
    ]:
        bad.write_text(text)
        with pytest.raises((typer.BadParameter, ValueError), match=problem):
            load_config(bad)


def test_without_ray_the_command_names_the_extra(monkeypatch):
    from typer.testing import CliRunner

    from staleflow_cli.main import app

    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    res = CliRunner().invoke(app, ["launch", "ray", "--config", str(REPO / "deploy" / "ray" / "run.toml")])
    assert res.exit_code == 1 and "staleflow[ray]" in res.output, res.output


@pytest.mark.slow
@pytest.mark.db
def test_ray_run_survives_a_node_removal(db_url, tmp_path):
    from staleflow_cli.launch_ray import actors_info, load_config

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            **NODE,
            "resources": {"control": 100},
            "include_dashboard": False,
            "_system_config": FAST_FAILURE,
        },
    )
    workers = [
        cluster.add_node(**NODE, resources={"worker": 100, "zone_a": 1}),
        cluster.add_node(**NODE, resources={"worker": 100, "zone_b": 1}),
    ]
    cluster.wait_for_nodes()
    namespace = f"sf-test-{uuid.uuid4().hex[:8]}"
    config = _config(tmp_path / "run.toml", cluster.address, namespace, db_url, tmp_path / "nodes")
    cfg = load_config(config)
    out = open(tmp_path / "launch.log", "w+")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "staleflow_cli.main", "launch", "ray", "--config", str(config), "--timeout", "240"],
        cwd=REPO,
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    engine = make_engine(db_url)
    try:

        def launcher_alive() -> None:
            assert launcher.poll() is None, f"the launcher exited early:\n{(tmp_path / 'launch.log').read_text()}"

        ray.init(address=cluster.address, namespace=namespace, log_to_driver=False, logging_level="WARNING")
        _until(lambda: len(ray.util.list_named_actors()) == 9, "the 9 actors", 60, launcher_alive)
        run_id = None

        def version() -> int:
            nonlocal run_id
            run_id = run_id or find_run(engine, "ray-e2e")
            return Protocol(engine).reads.status(run_id)["version"]

        _until(lambda: version() >= 2, "two versions", 120, launcher_alive)
        info = actors_info(cfg)
        nodes = {name.split(".", 1)[1]: i["node_id"] for name, i in info.items()}
        assert len(nodes) == 9 and all(i["running"] for i in info.values()), info
        head = cluster.head_node.node_id
        assert {nodes["api-0"], nodes["api-1"], nodes["coordinator-0"], nodes["coordinator-1"]} == {head}
        assert nodes["trainer-0"] == nodes["ps-0"] != head  # the placement group
        assert set(nodes.values()) == {head, *(w.node_id for w in workers)}, nodes  # all three nodes used

        # A process that dies is restarted by its actor, in place.
        reward = ray.get_actor("ray-e2e.reward-0")
        os.kill(info["ray-e2e.reward-0"]["pid"], signal.SIGKILL)
        _until(
            lambda: (lambda i: i["starts"] == 2 and i["running"])(ray.get(reward.info.remote())),
            "the reward worker's restart",
            30,
            launcher_alive,
        )

        victim = next(w for w in workers if w.node_id == nodes["trainer-0"])
        moved = {role for role, node in nodes.items() if node == victim.node_id}
        before = version()
        cluster.remove_node(victim)
        survivor = next(w for w in workers if w is not victim).node_id

        def back() -> bool:
            now = actors_info(cfg, timeout=5)
            return len(now) == 9 and all(
                i["running"] and (i["node_id"] == survivor if n.split(".", 1)[1] in moved else True)
                for n, i in now.items()
            )

        _until(back, f"{sorted(moved)} to come back on the other worker node", 90, launcher_alive)
        _until(lambda: version() >= before + 2, "two versions after the node removal", 90, launcher_alive)

        assert launcher.wait(timeout=180) == 0, (tmp_path / "launch.log").read_text()
        log = (tmp_path / "launch.log").read_text()
        shown = [int(k) for k in re.findall(rf"step (\d+)/{STEPS}", log)]  # progress while it ran
        assert len(set(shown)) >= 3 and shown == sorted(shown) and shown[-1] == STEPS, log
        assert "staleness_violations: 0" in log, log
        assert ray.util.list_named_actors() == []  # stopped, nothing restarts it
        assert version() >= STEPS
        assert violations(engine, run_id) == []
        audit = _cli("audit", "--strict", "ray-e2e", timeout=60)  # the complete audit, as an operator runs it
        assert audit.returncode == 0 and "staleness_violations: none" in audit.stdout, audit.stdout + audit.stderr
    finally:
        if launcher.poll() is None:
            launcher.kill()
        stop = _cli("launch", "ray", "--stop", "--config", str(config), timeout=120)
        engine.dispose()
        ray.shutdown()
        cluster.shutdown()
        out.close()
    assert stop.returncode == 0 and "nothing running" in stop.stdout, stop.stdout + stop.stderr
