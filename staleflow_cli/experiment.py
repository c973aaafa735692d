"""``staleflow experiment staleness``: does a staleness bound η cost learning?

The demo's task, model and step budget, run once per (η, TIS on/off, seed) with the demo's
launcher (every process real, η = 0 synchronous). Writes a JSON with every run's per-step
reward and accuracy, a Markdown table (final accuracy and reward per η, mean ± std over the
seeds, samples/s) and one PNG with the curves overlaid.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from staleflow_cli.common import need
from staleflow_cli.demo import DemoConfig, final_means, run_demo
from staleflow_cli.launch import ProcessDied
from workers.extras import require

app = typer.Typer(help="Learning experiments on the demo task (real processes).", no_args_is_help=True)


@app.callback()
def _group() -> None:
    """Keeps `staleness` a subcommand (typer collapses a one-command app into that command)."""


def _ints(spec: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"comma-separated integers, got {spec!r}", param_hint=what) from None
    if not out or min(out) < 0:
        raise typer.BadParameter("need at least one value, none negative", param_hint=what)
    return out


def run_one(base: DemoConfig, eta: int, tis: bool, seed: int, console: Console) -> dict[str, Any]:
    result = run_demo(replace(base, eta=eta, tis=tis, seed=seed), console)
    steps = result["steps"]
    acc, reward = final_means(steps)
    samples = sum(s["samples"] for s in steps)
    return {
        "eta": eta,
        "tis": tis,
        "seed": seed,
        "run": result["name"],
        "final_accuracy": acc,
        "final_reward": reward,
        "max_reward": result["max_reward"],
        "samples_per_s": samples / result["elapsed_s"] if result["elapsed_s"] > 0 else 0.0,
        "elapsed_s": result["elapsed_s"],
        "violations": len(result["audit"]["violations"]),
        "reward": [s["mean_reward"] for s in steps],
        "accuracy": [s["accuracy"] for s in steps],
    }


def _spread(xs: list[float]) -> str:
    return f"{statistics.fmean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def table(runs: list[dict[str, Any]]) -> str:
    """Markdown: one row per (η, TIS), figures over the seeds."""
    lines = [
        "| η | TIS | seeds | final accuracy | final reward | samples/s |",
        "|---|---|---|---|---|---|",
    ]
    for key in sorted({(r["eta"], r["tis"]) for r in runs}):
        rs = [r for r in runs if (r["eta"], r["tis"]) == key]
        lines.append(
            f"| {key[0]} | {'on' if key[1] else 'off'} | {len(rs)} | {_spread([r['final_accuracy'] for r in rs])} "
            f"| {_spread([r['final_reward'] for r in rs])} | {_spread([r['samples_per_s'] for r in rs])} |"
        )
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    matplotlib = require("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(13, 4.5))
    keys = sorted({(r["eta"], r["tis"]) for r in runs})
    colors = plt.get_cmap("viridis")
    for i, key in enumerate(keys):
        rs = [r for r in runs if (r["eta"], r["tis"]) == key]
        n = min(len(r["reward"]) for r in rs)
        style = "-" if key[1] else "--"
        label = f"η={key[0]} TIS {'on' if key[1] else 'off'}"
        for j, metric in enumerate(("reward", "accuracy")):
            mean = [statistics.fmean(r[metric][k] for r in rs) for k in range(n)]
            ax[j].plot(range(n), mean, style, color=colors(i / max(1, len(keys) - 1)), label=label)
    ax[0].set(title="mean reward per step (mean over seeds)", xlabel="step", ylabel="reward")
    ax[1].set(title="accuracy (exact answers) per step", xlabel="step", ylabel="accuracy")
    ax[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(runs: list[dict[str, Any]], base: DemoConfig, out: Path, name: str = "staleness") -> None:
    out.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(base).items()}
    (out / f"{name}.json").write_text(json.dumps({"config": config, "runs": runs}, indent=1))
    md = f"# Staleness experiment\n\nSteps {base.steps}, B={base.batch_size}, N={base.group_size}, lr {base.lr}.\n\n"
    (out / f"{name}.md").write_text(md + table(runs) + f"\n\n![curves]({name}.png)\n")
    plot(runs, out / f"{name}.png")


@app.command()
def staleness(
    etas: str = typer.Option("0,1,2,4,8", help="Comma-separated staleness bounds (0: synchronous)."),
    seeds: int = typer.Option(3, min=1, help="Seeds per configuration (prompts and initial weights)."),
    steps: int = typer.Option(DemoConfig.steps, min=1, help="Training steps per run."),
    tis: str = typer.Option("both", help="Truncated importance sampling: on, off or both."),
    instances: int = typer.Option(DemoConfig.instances, min=1, help="torch rollout workers per run."),
    out: Path = typer.Option(Path("bench/results"), help="Where staleness.{md,json,png} go."),
    report_dir: Path = typer.Option(Path("reports"), help="Where each run's report folder goes."),
    timeout: float = typer.Option(DemoConfig.timeout_s, min=1.0, help="Per run: give up after this many seconds."),
    append: bool = typer.Option(False, help="Add to the runs already in OUT/staleness.json (e.g. TIS off at one η)."),
) -> None:
    """The demo at each η, TIS on and off, over seeds: reward and accuracy curves, final accuracy."""
    if tis not in ("on", "off", "both"):
        raise typer.BadParameter("on, off or both", param_hint="--tis")
    need("torch", "matplotlib")
    console = Console()
    base = DemoConfig(steps=steps, instances=instances, report_dir=report_dir, timeout_s=timeout)
    modes = {"on": [True], "off": [False], "both": [True, False]}[tis]
    runs: list[dict[str, Any]] = []
    if append and (out / "staleness.json").is_file():
        runs = json.loads((out / "staleness.json").read_text())["runs"]
    # With --append a configuration already measured is not run again: re-running the same
    # command completes an interrupted experiment or retries the runs that failed.
    done = {(r["eta"], r["tis"], r["seed"]) for r in runs}
    failed: list[str] = []
    for eta in _ints(etas, "--etas"):
        for mode in modes:
            for seed in range(seeds):
                if (eta, mode, seed) in done:
                    console.print(f"eta={eta} tis={mode} seed={seed}: already in {out / 'staleness.json'}")
                    continue
                try:
                    runs.append(run_one(base, eta, mode, seed, console))
                except ProcessDied as e:
                    console.print(f"[red]eta={eta} tis={mode} seed={seed} failed:[/red] {e}")
                    failed.append(f"eta={eta} tis={mode} seed={seed}")
                    continue
                write(runs, base, out)  # after every run: a long experiment keeps what it has
    if not runs:
        raise typer.Exit(1)
    console.print(table(runs))
    console.print(f"results: {out / 'staleness.md'}")
    if failed:
        console.print(
            f"[red]{len(failed)} run(s) failed[/red] ({', '.join(failed)}): re-run with --append to retry them"
        )
        raise typer.Exit(1)
