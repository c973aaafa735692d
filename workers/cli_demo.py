"""``staleflow demo``: the main job, end to end on this machine."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from workers.coordinator.policies import POLICY_NAMES
from workers.launch import ProcessDied


def demo(
    steps: int = typer.Option(100, min=1, help="Training steps (versions) to run."),
    instances: int = typer.Option(3, min=1, help="torch rollout workers."),
    policy: str = typer.Option("staleflow", help=f"Coordinator policy: {', '.join(POLICY_NAMES)}."),
    eta: int = typer.Option(1, min=0, help="Staleness bound."),
    batch_size: int = typer.Option(8, min=1, help="B: prompt groups per step."),
    group_size: int = typer.Option(4, min=2, help="N: responses per prompt."),
    lr: float = typer.Option(1e-3, min=0.0, help="Learning rate."),
    seed: int = typer.Option(0, help="Prompt seed."),
    report_dir: Path = typer.Option(Path("reports"), help="Where the report folder goes."),
    timeout: float = typer.Option(1200.0, min=1.0, help="Give up after this many seconds."),
) -> None:
    """Train a tiny model from scratch with asynchronous RL: every process real, every step in PostgreSQL."""
    from workers.demo import DemoConfig, run_demo

    if policy not in POLICY_NAMES:
        raise typer.BadParameter(f"unknown policy {policy!r}; known: {', '.join(POLICY_NAMES)}", param_hint="--policy")
    console = Console()
    cfg = DemoConfig(steps=steps, instances=instances, policy=policy, eta=eta, batch_size=batch_size,
                     group_size=group_size, lr=lr, seed=seed, report_dir=report_dir, timeout_s=timeout)
    try:
        result = run_demo(cfg, console)
    except ProcessDied as e:
        console.print(f"[red]demo failed:[/red] {e}")
        raise typer.Exit(1) from None
    if result["audit"]["violations"]:
        raise typer.Exit(1)
