"""Real-service policy comparison: `staleflow serve`, the coordinator, eight `sim` rollout
workers, a reward worker and the sim trainer as separate processes on one database, at a time
scale — next to the discrete-event simulator on the same set-up, so the two orderings of
`staleflow` vs `strict` vs `sync` can be compared. Also reports the coordination overhead
(cycle time, command latency) as a fraction of step time.

    python bench/service.py [--steps 8] [--time-scale 0.25] [--policies staleflow,strict,sync]

Figures, not pass/fail; the last line is `service: <ordering>  simulator: <ordering>`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path

# bench/api.py would shadow the `api` package when this runs as `python bench/service.py`
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from rich.console import Console
from sqlalchemy import text

from api.auth import create_token
from staleflow_cli.launch import Cluster
from staleflow_db import migrate
from staleflow_db.audit import step_metrics, summary
from staleflow_db.db import database_url, make_engine
from staleflow_db.protocol import Prompt, Protocol
from staleflow_db.types import RunConfig
from workers.coordinator.policies import get_policy
from workers.rollout.engines.sim_engine import encode_prompt
from workers.sim.setups import get_setup
from workers.sim.simulator import simulate
from workers.sim.workload import Workload

console = Console(stderr=True)
SETUP = dict(
    name="service",
    batch_size=16,
    group_size=4,
    max_response=2048,
    instances=8,
    kv_capacity_override=24_000,
    train_gpus=4,
    step_time_scale=0.3,
)


def service_setup():
    return get_setup("qwen_7b").scaled(**SETUP)


def service_run(policy: str, eta: int, steps: int, scale: float, workdir: Path, url: str) -> dict:
    setup = service_setup()
    pol = get_policy(policy)
    engine = make_engine(url)
    protocol = Protocol(engine)
    name = f"service-{policy}-{int(time.time())}"
    run = protocol.create_run(
        name,
        RunConfig(
            batch_size=setup.batch_size,
            group_size=setup.group_size,
            eta=pol.effective_eta(eta),
            max_response_tokens=setup.max_response,
            max_prompt_tokens=4096,
        ),
    )
    work = Workload(setup.workload, seed=0)
    prompts = []
    for k in range(3 * steps * setup.batch_size):
        g = work.group(k, setup.group_size)
        median = math.exp(statistics.fmean(math.log(x) for x in g.lengths))
        prompts.append(Prompt(f"g{k}", encode_prompt(min(g.prompt_len, 512), median, work._sd_member)))
    protocol.enqueue(run, prompts)
    tokens = {r: create_token(engine, r, run)["token"] for r in ("trainer", "rollout", "reward", "coordinator")}
    sim_env = {
        "STALEFLOW_SIM_MODEL": setup.model,
        "STALEFLOW_SIM_PARALLELISM": setup.parallelism,
        "STALEFLOW_SIM_TIME_SCALE": str(scale),
        "STALEFLOW_SIM_PULL_S": str(setup.pull_time),
        "STALEFLOW_SIM_PREFILL_RATE": str(setup.prefill_rate),
    }
    started = time.monotonic()
    with Cluster(workdir / name, url, env=sim_env) as cluster:
        cluster.start_api()
        common = ["--run", str(run)]
        cluster.spawn(
            "coordinator",
            [
                "coordinator",
                *common,
                "--policy",
                policy,
                "--model",
                setup.model,
                "--parallelism",
                setup.parallelism,
                "--lease",
                "3",
            ],
        )
        cluster.spawn(
            "reward", ["reward-worker", *common, "--verifier", "sim"], env={"STALEFLOW_TOKEN": tokens["reward"]}
        )
        for i in range(setup.instances):
            args = [
                "rollout-worker",
                *common,
                "--engine",
                "sim",
                "--kv-capacity",
                str(setup.kv_capacity),
                "--max-running",
                str(setup.max_running),
                "--name",
                f"sim-{i}",
                "--heartbeat",
                "0.25",
            ]
            if pol.phi is not None:
                args += ["--phi-wait", str(pol.phi)]
            cluster.spawn(f"rollout-{i}", args, env={"STALEFLOW_TOKEN": tokens["rollout"]})
        cluster.spawn(
            "trainer",
            [
                "trainer",
                *common,
                "--sim",
                "--steps",
                str(steps),
                "--time-scale",
                str(scale),
                "--sim-overhead",
                str(setup.train_step_time(0)),
                "--sim-s-per-token",
                str(setup.train_seconds_per_token),
            ],
            env={"STALEFLOW_TOKEN": tokens["trainer"]},
        )
        while protocol.reads.status(run)["version"] < steps:
            cluster.check()
            if time.monotonic() - started > 60 + steps * 120:
                raise RuntimeError(f"{policy}: too slow")
            time.sleep(0.5)
    rows = step_metrics(engine, run)[1:]  # step 0 includes start-up
    wall = sum(r["seconds"] for r in rows)
    toks = sum(r["tokens"] for r in rows)
    with engine.connect() as c:
        cyc = c.execute(
            text(
                "SELECT avg(snapshot_ms + decide_ms + write_ms), count(*), avg(snapshot_ms), avg(decide_ms),"
                " avg(write_ms) FROM coordinator_cycles WHERE run_id = :r"
            ),
            {"r": run},
        ).first()
        # Per delivered command, from the snapshot its cycle read to its delivery: the cycle's
        # snapshot and decide times, then the database's clock from the write transaction's
        # start (the command's created_at, the cycle row's `at`) to the delivering poll's start:
        # the writes, the commit, the wake-up and the poll, all measured, none counted twice.
        e2e = c.execute(
            text(
                "SELECT avg(y.snapshot_ms + y.decide_ms + extract(epoch FROM m.delivered_at - m.created_at) * 1000)"
                " FROM commands m JOIN coordinator_cycles y ON y.run_id = m.run_id AND y.epoch = m.epoch"
                " AND y.at = m.created_at WHERE m.run_id = :r AND m.delivered_at IS NOT NULL"
            ),
            {"r": run},
        ).scalar()
        lat = c.execute(
            text(
                "SELECT avg(extract(epoch FROM delivered_at - created_at)) FROM commands"
                " WHERE run_id = :r AND delivered_at IS NOT NULL"
            ),
            {"r": run},
        ).scalar()
    inbox = inbox_wait_ms(workdir / name / "logs")
    violations = len(summary(engine, run)["violations"])
    engine.dispose()
    step_s = wall / max(len(rows), 1)
    cycles_per_step = (cyc[1] or 0) / max(len(rows) + 1, 1)
    return {
        "policy": policy,
        "eta": pol.effective_eta(eta),
        "steps": len(rows),
        "tokens_per_s": toks / wall * scale if wall else 0.0,  # in simulated seconds
        "step_s_wall": step_s,
        "cycle_ms": float(cyc[0] or 0.0),
        "snapshot_ms": float(cyc[2] or 0.0),
        "decide_ms": float(cyc[3] or 0.0),
        "write_ms": float(cyc[4] or 0.0),  # the commands before the cycle's row, not the commit (docs/coordinator.md)
        "command_latency_ms": float(lat or 0.0) * 1000,
        # delivered -> applied: a command waits in the worker's inbox for the engine step in progress
        "command_inbox_ms": inbox,
        # the delay a decision adds on the critical path (cycle + deliver), per step of training;
        # an upper bound: the write's statements are in both cycle_ms and the delivery
        "coordination_fraction": (float(cyc[0] or 0.0) + float(lat or 0.0) * 1000) / 1000 / step_s if step_s else 0.0,
        # snapshot -> delivery per command, measured end to end (see `e2e` above)
        "decision_delay_fraction": float(e2e or 0.0) / 1000 / step_s if step_s else 0.0,
        "coordinator_busy": float(cyc[0] or 0.0) * cycles_per_step / 1000 / step_s if step_s else 0.0,
        "violations": violations,
    }


def inbox_wait_ms(logs: Path) -> float | None:
    """Mean time delivered commands waited for the engine step in progress, from the rollout
    workers' exit lines; None when no worker logged one."""
    n = total = 0.0
    for log in logs.glob("rollout-*.log"):
        for m in re.finditer(r"(\d+) commands applied, ([\d.]+) ms after delivery", log.read_text(errors="replace")):
            n += int(m[1])
            total += int(m[1]) * float(m[2])
    return total / n if n else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--eta", type=int, default=2)
    ap.add_argument("--time-scale", type=float, default=0.25, help="wall seconds per simulated second")
    ap.add_argument("--policies", default="staleflow,strict,sync")
    ap.add_argument("--workdir", type=Path, default=Path("bench/results/service"))
    args = ap.parse_args()
    policies = args.policies.split(",")
    url = database_url()
    migrate.upgrade(url)
    results = {"service": [], "simulator": []}
    for p in policies:
        console.print(f"[bold]{p}[/bold]: simulator ...")
        r = simulate(service_setup(), p, args.eta, steps=args.steps + 1)
        results["simulator"].append({"policy": p, "tokens_per_s": r.steady_tokens_per_s})
        console.print(f"[bold]{p}[/bold]: real service (8 sim workers, time scale {args.time_scale}) ...")
        results["service"].append(service_run(p, args.eta, args.steps, args.time_scale, args.workdir, url))
        console.print(f"  {results['service'][-1]}")
    args.workdir.mkdir(parents=True, exist_ok=True)
    (args.workdir / "service.json").write_text(json.dumps(results, indent=2))
    sim = {r["policy"]: r["tokens_per_s"] for r in results["simulator"]}
    print(
        f"{'policy':<12} {'service tok/s':>14} {'simulator tok/s':>16} {'cycle ms':>9} {'cmd latency ms':>15} "
        f"{'coord/step':>11} {'e2e/step':>9} {'violations':>10} {'cmd inbox ms':>13}"
    )
    for r in results["service"]:
        print(
            f"{r['policy']:<12} {r['tokens_per_s']:>14.0f} {sim[r['policy']]:>16.0f} {r['cycle_ms']:>9.1f} "
            f"{r['command_latency_ms']:>15.1f} {r['coordination_fraction']:>10.2%} "
            f"{r['decision_delay_fraction']:>8.2%} {r['violations']:>10} "
            f"{'-' if r['command_inbox_ms'] is None else format(r['command_inbox_ms'], '.1f'):>13}"
        )
    order = lambda d: " > ".join(sorted(d, key=d.get, reverse=True))  # noqa: E731
    print(f"service: {order({r['policy']: r['tokens_per_s'] for r in results['service']})}  simulator: {order(sim)}")


if __name__ == "__main__":
    sys.exit(main())
