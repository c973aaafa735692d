"""``staleflow sim ...``: the discrete-event simulator of coordinator policies.

Mounted in ``staleflow_cli/main.py`` with ``app.add_typer(sim_app, name="sim")``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from staleflow_cli.common import need

app = typer.Typer(help="Simulate policies on the cost model (virtual time, no database).", no_args_is_help=True)


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@app.command()
def run(
    model: str = typer.Option(
        "qwen_14b",
        "--model",
        "--setup",
        help="Set-up (docs/policies.md): qwen_14b, qwen_32b, qwen_moe_30b, qwen_7b, small, tiny.",
    ),
    policy: str = typer.Option(
        "staleflow",
        help="sync, one_step, strict, staleflow, staleflow-naive-route, staleflow-greedy-pull, staleflow-no-migration.",
    ),
    eta: int = typer.Option(2, help="Staleness bound (sync forces 0, one_step 1)."),
    steps: int = typer.Option(20, help="Training steps to simulate."),
    seed: int = typer.Option(0, help="Workload seed."),
    mu: float = typer.Option(None, help="Override μ (waterfall routing)."),
    psi: float = typer.Option(None, help="Override ψ (migration)."),
    phi_wait: int = typer.Option(None, help="Override φ_wait (engine-side migration)."),
    kv_threshold: float = typer.Option(None, help="Override the pull KV threshold."),
    as_json: bool = typer.Option(False, "--json", help="Print the full result as JSON."),
) -> None:
    """Simulate one policy on one set-up and print its throughput and staleness."""
    from workers.coordinator.policies import get_policy
    from workers.sim.simulator import simulate

    overrides = {
        k: v for k, v in dict(mu=mu, psi=psi, phi_wait=phi_wait, kv_threshold=kv_threshold).items() if v is not None
    }
    try:
        pol = get_policy(policy, **overrides)
    except KeyError as e:
        raise typer.BadParameter(str(e)) from None
    r = simulate(model, pol, eta=eta, steps=steps, seed=seed, progress=_err)
    if as_json:
        print(json.dumps(r.to_dict(), indent=1, default=str))
    else:
        print(r.summary())
        print(
            f"commands: {r.commands}; snapshots: {r.snapshots}; cycles: {r.cycles} "
            f"({1000 * r.coordinator_wall_s / max(r.cycles, 1):.2f} ms each)"
        )
    if r.invariant_violations:
        _err("PROTOCOL INVARIANT VIOLATIONS:\n" + "\n".join(r.invariant_violations[:20]))
        raise typer.Exit(1)


@app.command()
def bench(
    quick: bool = typer.Option(False, help="CI-sized: the small set-up, 10 steps."),
    setups: str = typer.Option(
        None, help="Comma-separated set-ups (default: the four reference set-ups and the workload shapes)."
    ),
    steps: int = typer.Option(None, help="Training steps per run (default 32)."),
    jobs: int = typer.Option(None, help="Parallel processes."),
    seeds: str = typer.Option("0", help="Comma-separated workload seeds (means over them)."),
    out: Path = typer.Option(Path("bench/results"), help="Where policies.md, policies.json and the plots go."),
) -> None:
    """Every policy on every set-up and η; writes a markdown table and plots. The last line
    printed is `staleflow/sync=<avg> staleflow/strict=<avg>`."""
    from workers.sim.bench import BenchConfig, run_bench

    need("matplotlib")  # for the plots at the end, not after the runs
    cfg = BenchConfig.quick() if quick else BenchConfig()
    if setups:
        cfg.setups = tuple(s.strip() for s in setups.split(",") if s.strip())
    if steps:
        cfg.steps = steps
    if jobs:
        cfg.jobs = jobs
    cfg.seeds = tuple(int(x) for x in seeds.split(","))
    _, line = run_bench(cfg, out, progress=lambda m: print(m, flush=True))
    print(line, flush=True)


if __name__ == "__main__":
    app()
