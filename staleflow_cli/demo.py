"""`staleflow demo`: asynchronous RL post-training of a tiny model, end to end, on one machine.

The API, parameter server, trainer, coordinator, reward worker and several `torch` rollout
workers run as separate processes on the embedded PostgreSQL (or STALEFLOW_DATABASE_URL),
exactly as they would across machines. The model learns the toy `repeat` task from a warm
start, or (`--task multiturn`) a multi-turn search with an environment answering each turn
(workers/tasks/guess.py); every step is recorded in PostgreSQL, and the run ends with a
per-step table, the audit, and a report folder (JSON + PNG plots).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from sqlalchemy import Engine

from api.auth import create_token
from api.ui.report import dashboard_data, write_report_html
from staleflow_cli.common import need, torch_device
from staleflow_cli.launch import Cluster, ProcessDied
from staleflow_db import migrate
from staleflow_db.audit import last_step_reward, mean_turns, step_metrics, summary
from staleflow_db.audit import step_accuracy as accuracy_by_step
from staleflow_db.db import database_url, make_engine
from staleflow_db.protocol import Prompt, Protocol
from staleflow_db.types import RunConfig
from workers.coordinator.policies import POLICY_NAMES
from workers.extras import require
from workers.tasks.guess import GuessTask
from workers.tasks.repeat import RepeatTask

TASKS = ("repeat", "multiturn")
# the multi-turn task's environment and its text <-> tokens, for the rollout and reward workers
GUESS_ENV = ["--env", "workers.envs.guess:GuessEnv", "--codec", "workers.tasks.guess:GuessCodec"]
QUEUE_STEPS = 6  # steps' worth of prompts kept queued (covers eta, filtered groups, in-flight work)


MULTITURN_STEPS = 80  # the multi-turn demo's default: a few minutes here
MULTITURN_LR = 2e-3


@dataclass
class DemoConfig:
    steps: int = 150  # a few minutes on 2 cores; enough to pass 90% of the maximum reward (docs/benchmarks.md)
    instances: int = 3
    policy: str = "staleflow"
    eta: int = 1
    batch_size: int = 8  # B: prompt groups per training step
    group_size: int = 8  # N: more samples per prompt, a less noisy group baseline
    lr: float = 2e-3  # measured best of 1e-3, 2e-3, 3e-3 (AdamW, d_model 64)
    seed: int = 0  # prompts and initial weights
    kv_capacity: int = 2048
    timeout_s: float = 1200.0
    report_dir: Path = Path("reports")
    d_model: int = 64
    n_layers: int = 2
    head_std: float = 0.1  # a near-uniform initial policy explores; a peaked one gets stuck
    pos_std: float = 0.5  # distinct positions from the start: stopping after COUNT is learned sooner
    ppo_epochs: int = 4  # passes over each batch: more learning per rollout (the clip keeps it stable)
    lr_end: float = 0.1  # lr decays linearly to lr x lr_end at the last step: the policy settles
    warm_start_steps: int = 200  # supervised steps on imperfect demonstrations (0: from scratch)
    warm_start_noise: int = 3  # their lengths: COUNT +- 3, so only 1 in 7 is exact
    tis: bool = True  # truncated importance sampling in the trainer (off: --tis-cap 0)
    # DAPO's filter drops groups whose samples all scored the same. Off here: as the model
    # learns, most groups are all-exact, so a step needed 5-10x the rollouts (60 s waits),
    # and the step figures (trained samples only) would leave out exactly the solved groups
    dapo_filter: bool = False
    model: Path | None = None  # a Hugging Face model folder instead of the tiny model
    device: str = "cpu"  # torch device of the trainer and the rollout engines ("cuda" on a GPU host)
    task: str = "repeat"  # or "multiturn": the guessing search (workers/tasks/guess.py)
    guess_noise: float = 0.25  # multiturn warm start: a guess ignores the feedback this often (87% found)


Task = RepeatTask | GuessTask


def make_task(cfg: DemoConfig) -> Task:
    return GuessTask() if cfg.task == "multiturn" else RepeatTask()


def model_config(task: Task, cfg: DemoConfig) -> dict[str, Any]:
    return {
        "vocab_size": task.vocab_size,
        "d_model": cfg.d_model,
        "n_layers": cfg.n_layers,
        "n_heads": 4,
        "max_seq": 8 + task.max_response,
        "eos_token_id": 0,
        "head_std": cfg.head_std,
        "pos_std": cfg.pos_std,
    }


def max_reward(task: Task) -> float:
    """The verifier's reward for an exact answer: accuracy counts the samples that reach it."""
    from workers.tasks.verifiers import repeat_verifier

    if isinstance(task, GuessTask):
        return 1.0  # the environment's reward for finding the number

    _, meta = task.prompt(random.Random(0))
    return repeat_verifier([meta["symbol"]] * meta["count"] + [meta["eos"]], "eos", meta, lambda t: "")


def step_accuracy(engine: Engine, run: int, best: float) -> dict[int, float]:
    """Per trained step: the fraction of its samples with an exact answer (reward == best)."""
    return accuracy_by_step(engine, run, best - 1e-6)


def final_means(steps: list[dict]) -> tuple[float, float]:
    """Mean accuracy and reward over the last tenth of the steps (at least one)."""
    tail = steps[-max(1, len(steps) // 10) :] or [{"accuracy": 0.0, "mean_reward": 0.0}]
    return sum(s["accuracy"] for s in tail) / len(tail), sum(s["mean_reward"] for s in tail) / len(tail)


def run_demo(cfg: DemoConfig, console: Console) -> dict[str, Any]:
    task = make_task(cfg)
    url = database_url()
    migrate.upgrade(url)
    engine = make_engine(url)
    protocol = Protocol(engine)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    name = f"demo-{stamp}"
    # twice what the steps consume (filtered groups are replaced, in-flight work spills over),
    # enqueued a few steps ahead of the trainer (_top_up)
    prompts = _prompts(task, cfg, 2 * cfg.steps * cfg.batch_size, name)
    run = protocol.create_run(
        name,
        RunConfig(
            batch_size=cfg.batch_size,
            group_size=cfg.group_size,
            eta=cfg.eta,
            dapo_filter=cfg.dapo_filter,
            max_response_tokens=task.max_response,
            max_prompt_tokens=max(8, *(len(t) for _, t, _ in prompts)),
        ),
    )
    pending = [Prompt(k, t, m) for k, t, m in prompts]
    _top_up(protocol, run, pending, cfg)
    report = (cfg.report_dir / name).resolve()
    console.print(
        f"[bold]run {name}[/bold] (id {run}): B={cfg.batch_size} N={cfg.group_size} eta={cfg.eta} "
        f"policy={cfg.policy}, {cfg.instances} rollout workers; logs in {report / 'logs'}"
    )
    tokens = {r: create_token(engine, r, run)["token"] for r in ("trainer", "rollout", "reward", "coordinator")}
    mc = json.dumps(model_config(task, cfg))
    model = ["--model", str(cfg.model)] if cfg.model else ["--model-config", mc]
    started = time.monotonic()
    with Cluster(report, url) as cluster:
        api_url = cluster.start_api()
        # An observer token reads everything of this run and writes nothing: safe to paste.
        observer = create_token(engine, "observer", run, "dashboard")["token"]
        console.print(
            f"dashboard: {api_url}/ui/login?token={observer}&next=/ui/runs/{run}", highlight=False, soft_wrap=True
        )
        ps_ready = report / "ps.json"
        cluster.spawn(
            "ps",
            ["ps", "--run", str(run), "--data-dir", str(report / "ps"), "--port", "0", "--ready-file", str(ps_ready)],
            env={"STALEFLOW_TOKEN": tokens["trainer"]},  # the PS fetches the run's keys with it
        )
        cluster.wait_file(ps_ready)
        ps = json.loads(ps_ready.read_text())
        ps_addr = f"{ps['host']}:{ps['port']}"
        common = ["--run", str(run)]
        cluster.spawn(
            "trainer",
            [
                "trainer",
                *common,
                "--ps",
                ps_addr,
                "--checkpoint-dir",
                str(report / "checkpoint"),
                "--steps",
                str(cfg.steps),
                "--lr",
                str(cfg.lr),
                *([] if cfg.tis else ["--tis-cap", "0"]),
                *_learning_options(task, cfg, report),
                "--model-seed",
                str(cfg.seed),
                *model,
                # the tiny model's checkpoints are small (~3x its weights): keep every version's,
                # so any step replays (`staleflow replay`)
                *([] if cfg.model else ["--save-every", "1"]),
                "--metrics-file",
                str(report / "trainer.jsonl"),
                "--device",
                cfg.device,
            ],
            env={"STALEFLOW_TOKEN": tokens["trainer"]},
        )
        scoring = GUESS_ENV if cfg.task == "multiturn" else ["--verifier", "repeat"]
        cluster.spawn("reward", ["reward-worker", *common, *scoring], env={"STALEFLOW_TOKEN": tokens["reward"]})
        for i in range(cfg.instances):
            cluster.spawn(
                f"rollout-{i}",
                [
                    "rollout-worker",
                    *common,
                    "--engine",
                    "hf" if cfg.model else "torch",
                    "--ps",
                    ps_addr,
                    *model,
                    "--kv-capacity",
                    str(cfg.kv_capacity),
                    "--phi-wait",
                    "1",
                    "--device",
                    cfg.device,
                    "--name",
                    f"{cfg.device.replace(':', '')}-{i}",
                    "--heartbeat",
                    "0.5",
                    *(GUESS_ENV if cfg.task == "multiturn" else []),
                ],
                env={"STALEFLOW_TOKEN": tokens["rollout"]},
            )
        cluster.spawn("coordinator", ["coordinator", *common, "--policy", cfg.policy, "--lease", "10"])
        _follow(cluster, protocol, engine, run, cfg, console, pending)
    elapsed = time.monotonic() - started
    steps = step_metrics(engine, run)
    best = max_reward(task)
    accuracy = step_accuracy(engine, run, best)
    for s in steps:
        s["accuracy"] = accuracy.get(s["step"], 0.0)
    audit = summary(engine, run)
    # The dashboard's panels as a static page: the finished run can be looked at without the service.
    write_report_html(report, dashboard_data(protocol.reads, run))
    result = {
        "run_id": run,
        "name": name,
        "config": {**asdict(cfg), "report_dir": str(cfg.report_dir)},
        "model": str(cfg.model) if cfg.model else json.loads(mc),
        "elapsed_s": elapsed,
        "max_reward": best,
        "steps": steps,
        "audit": audit,
    }
    write_report(report, result)
    print_result(result, console)
    console.print(f"report: {report}")
    acc, reward = final_means(steps)
    task_part = ""
    if cfg.task == "multiturn":  # mean turns per trajectory over the steps the figures average
        tail = steps[-max(1, len(steps) // 10) :]
        turns = mean_turns(engine, run, tail[0]["step"] if tail else 0) or 0.0
        result["turns"] = turns
        task_part = f"task=multiturn steps={len(steps)} turns={turns:.2f}"
    else:
        task_part = f"steps={len(steps)}"
    engine.dispose()
    console.print(  # the last line, for scripts
        f"demo {task_part} accuracy={acc:.3f} reward={reward:.3f} "
        f"max_reward={best:.3f} violations={len(audit['violations'])}",
        highlight=False,
        soft_wrap=True,
    )
    return result


def _learning_options(task: Task, cfg: DemoConfig, report: Path) -> list[str]:
    """The trainer's options that make the demo learn: PPO epochs, lr decay, one thread (the
    CPU is shared with the rollout workers), and (tiny model) the warm-start weights for
    version 0, computed here in seconds."""
    out = ["--ppo-epochs", str(cfg.ppo_epochs), "--lr-end", str(cfg.lr_end), "--threads", "1"]
    if cfg.model is not None or cfg.warm_start_steps <= 0:
        return out
    import torch

    from workers.models.tiny_model import TinyConfig, TinyTransformer
    from workers.tasks.warm_start import warm_start

    model = TinyTransformer(TinyConfig(**model_config(task, cfg)), seed=cfg.seed)
    if isinstance(task, GuessTask):
        guess = task  # bound for the closure (mypy narrows the name only here)
        warm_start(
            model, RepeatTask(), cfg.warm_start_steps, seed=cfg.seed, demo=lambda rng: guess.demo(rng, cfg.guess_noise)
        )
    else:
        warm_start(model, task, cfg.warm_start_steps, seed=cfg.seed, noise=cfg.warm_start_noise)
    report.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), report / "warm_start.pt")
    return [*out, "--init-weights", str(report / "warm_start.pt")]


def _prompts(task: Task, cfg: DemoConfig, n: int, name: str) -> list[tuple[str, list[int], dict]]:
    if cfg.model is None or isinstance(task, GuessTask):
        return task.prompts(n, seed=cfg.seed, prefix=name)
    from workers.models.hf import load_tokenizer
    from workers.tasks.text import repeat_prompts

    return repeat_prompts(load_tokenizer(cfg.model), n, seed=cfg.seed, prefix=name, task=task)


def _top_up(protocol: Protocol, run: int, pending: list[Prompt], cfg: DemoConfig, queued: int = 0) -> None:
    """Keep about QUEUE_STEPS steps' worth of prompts queued, enqueueing from `pending`.
    All at once, 2 x steps x B prompts made each coordinator cycle read thousands of queued
    samples: seconds per cycle on a loaded 2-core machine, the rollout workers idle."""
    want = QUEUE_STEPS * cfg.batch_size * cfg.group_size - queued
    if want <= 0 or not pending:
        return
    n = -(-want // cfg.group_size)
    protocol.enqueue(run, pending[:n])
    del pending[:n]


def _follow(
    cluster: Cluster,
    protocol: Protocol,
    engine,
    run: int,
    cfg: DemoConfig,
    console: Console,
    pending: list[Prompt] | None = None,
) -> None:
    """Progress until the trainer has published `steps` versions (or something dies)."""
    deadline = time.monotonic() + cfg.timeout_s
    columns = [
        TextColumn("[bold]training"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} steps"),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
    ]
    with Progress(*columns, console=console, transient=False) as bar:
        t = bar.add_task("steps", total=cfg.steps, info="starting processes")
        while True:
            try:
                cluster.check()
            except ProcessDied:
                # The trainer exits 0 right after its last publish, often before this
                # loop sees that version: a finished run is not a failure.
                if protocol.reads.status(run)["version"] >= cfg.steps:
                    bar.update(t, completed=cfg.steps)
                    return
                raise
            status = protocol.reads.status(run)
            info = f"running {status['samples'].get('running', 0)}, queued {status['samples'].get('queued', 0)}"
            reward = _last_reward(engine, run) if status["version"] else None
            if reward is not None:
                info += f", reward {reward:+.3f}"
            bar.update(t, completed=min(status["version"], cfg.steps), info=info)
            if status["version"] >= cfg.steps:
                return
            if pending:
                _top_up(protocol, run, pending, cfg, status["samples"].get("queued", 0))
            if time.monotonic() > deadline:
                raise ProcessDied(f"only {status['version']} of {cfg.steps} steps within {cfg.timeout_s:.0f}s")
            time.sleep(1.0)


def _last_reward(engine: Engine, run: int) -> float | None:
    """Mean reward of the last trained step: one indexed query, not the full audit (which,
    once a second on a long run, slowed every process and hit the statement timeout)."""
    return last_step_reward(engine, run)


def reward_trend(steps: list[dict]) -> tuple[float, float]:
    """Mean reward of the first and the last quarter of the steps."""
    k = max(1, len(steps) // 4)
    first = [s["mean_reward"] for s in steps[:k]]
    last = [s["mean_reward"] for s in steps[-k:]]
    return sum(first) / len(first), sum(last) / len(last)


def print_result(result: dict[str, Any], console: Console) -> None:
    from rich.table import Table

    eta = result["config"]["eta"]
    table = Table(title=f"{result['name']}: per-step figures")
    for col in (
        "step",
        "reward",
        "accuracy",
        *(f"stale {s}" for s in range(eta + 1)),
        "tokens/s",
        "interrupts",
        "migrations",
        "pulls",
    ):
        table.add_column(col, justify="right")
    for s in result["steps"]:
        table.add_row(
            str(s["step"]),
            f"{s['mean_reward']:+.3f}",
            f"{s['accuracy']:.2f}",
            *(str(s["staleness"].get(k, 0)) for k in range(eta + 1)),
            f"{s['tokens_per_s']:.0f}",
            str(s["interrupts"]),
            str(s["migrations"]),
            str(s["pulls"]),
        )
    console.print(table)
    first, last = reward_trend(result["steps"])
    console.print(f"mean reward: first quarter {first:+.3f} -> last quarter {last:+.3f}")
    audit = result["audit"]
    drops = ", ".join(f"{d['reason']} {d['samples']}" for d in audit["drops"]) or "none"
    console.print(f"dropped samples: {drops}")
    n = len(audit["violations"])
    console.print(f"staleness_violations: {n}" + (" [green](none)[/green]" if n == 0 else " [red]VIOLATED[/red]"))


def write_report(folder: Path, result: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps(result, indent=2, default=str))
    matplotlib = require("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = result["steps"]
    x = [s["step"] for s in steps]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    rewards = [s["mean_reward"] for s in steps]
    ax[0].plot(x, rewards, marker="o", alpha=0.5, label="per step")
    k = 5  # a short moving average shows the trend through the per-step noise
    smooth = [
        sum(rewards[max(0, i - k + 1) : i + 1]) / len(rewards[max(0, i - k + 1) : i + 1]) for i in range(len(rewards))
    ]
    ax[0].plot(x, smooth, linewidth=2, label=f"mean of last {k}")
    ax[0].plot(x, [s["accuracy"] for s in steps], linewidth=1, label="accuracy (exact answers)")
    ax[0].axhline(result["max_reward"], color="grey", linestyle=":", label="max reward")
    ax[0].legend()
    ax[0].set(title="mean reward and accuracy per step", xlabel="step", ylabel="reward / accuracy")
    secs = [sum(s["seconds"] for s in steps[: i + 1]) for i in range(len(steps))]
    ax[1].plot(secs, [s["tokens_per_s"] for s in steps], marker="o")
    ax[1].set(title="trained tokens/s", xlabel="seconds since start", ylabel="tokens/s")
    eta = result["config"]["eta"]
    totals = [sum(s["staleness"].get(k, 0) for s in steps) for k in range(eta + 1)]
    ax[2].bar(list(range(eta + 1)), totals)
    ax[2].set_xticks(list(range(eta + 1)))
    ax[2].set(title=f"staleness of trained samples (eta={eta})", xlabel="step - V_traj", ylabel="samples")
    fig.tight_layout()
    fig.savefig(folder / "demo.png", dpi=100)
    plt.close(fig)


def demo(
    task: str = typer.Option(
        "repeat", "--task", help=f"The toy task: {', '.join(TASKS)} (an environment, many turns)."
    ),
    steps: int | None = typer.Option(
        None, min=1, help=f"Training steps (versions) to run [repeat {DemoConfig.steps}, multiturn {MULTITURN_STEPS}]."
    ),
    instances: int = typer.Option(3, min=1, help="torch rollout workers."),
    policy: str = typer.Option("staleflow", help=f"Coordinator policy: {', '.join(POLICY_NAMES)}."),
    eta: int = typer.Option(1, min=0, help="Staleness bound."),
    batch_size: int = typer.Option(8, min=1, help="B: prompt groups per step."),
    group_size: int = typer.Option(DemoConfig.group_size, min=2, help="N: responses per prompt."),
    lr: float | None = typer.Option(
        None, min=0.0, help=f"Learning rate [repeat {DemoConfig.lr:g}, multiturn {MULTITURN_LR:g}]."
    ),
    seed: int = typer.Option(0, help="Seed of the prompts and the initial weights."),
    report_dir: Path = typer.Option(Path("reports"), help="Where the report folder goes."),
    timeout: float = typer.Option(1200.0, min=1.0, help="Give up after this many seconds."),
    model: Path | None = typer.Option(
        None, "--model", help="A Hugging Face model folder to train instead of the tiny model (engine hf)."
    ),
    device: str = typer.Option(
        "cpu", "--device", help="torch device of the trainer and the rollout engines: cpu, cuda, cuda:1 ..."
    ),
) -> None:
    """Train a tiny model from scratch with asynchronous RL: every process real, every step in PostgreSQL."""
    if policy not in POLICY_NAMES:
        raise typer.BadParameter(f"unknown policy {policy!r}; known: {', '.join(POLICY_NAMES)}", param_hint="--policy")
    if task not in TASKS:
        raise typer.BadParameter(f"unknown task {task!r}; known: {', '.join(TASKS)}", param_hint="--task")
    if task == "multiturn" and model is not None:
        raise typer.BadParameter("--task multiturn trains the tiny model (its own tokens)", param_hint="--model")
    need("torch", "matplotlib", *(["transformers"] if model else []))  # before a cluster starts
    torch_device(device)
    console = Console()
    cfg = DemoConfig(
        task=task,
        steps=steps or (MULTITURN_STEPS if task == "multiturn" else DemoConfig.steps),
        instances=instances,
        policy=policy,
        eta=eta,
        batch_size=batch_size,
        group_size=group_size,
        lr=lr if lr is not None else (MULTITURN_LR if task == "multiturn" else DemoConfig.lr),
        seed=seed,
        report_dir=report_dir,
        timeout_s=timeout,
        model=model,
        device=device,
    )
    try:
        result = run_demo(cfg, console)
    except ProcessDied as e:
        console.print(f"[red]demo failed:[/red] {e}")
        raise typer.Exit(1) from None
    if result["audit"]["violations"]:
        raise typer.Exit(1)
