"""``staleflow launch ray``: a whole run on an existing Ray cluster (deploy/ray/README.md).

Every role is a detached, named Ray actor (staleflow_cli/ray_actor.py) in the run's
namespace that runs the role's own ``staleflow`` command; Ray restarts an actor whose node
died (``max_restarts``) and the actor restarts a process that exited unexpectedly. The
launcher itself only prepares the database (migration, run, prompts, tokens), places the
actors, follows progress through the API, and stops them.
"""

from __future__ import annotations

import json
import logging
import os
import time
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console

from staleflow_cli.common import need

console = Console()

ROLES = ("api", "ps", "trainer", "reward", "rollout", "coordinator")  # start order
STOP_ORDER = ("coordinator", "rollout", "reward", "trainer", "ps", "api")  # the API last: others deregister through it


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RayCfg(_Strict):
    address: str = "auto"
    namespace: str = "staleflow"
    max_restarts: int = -1  # per actor; -1: for ever
    runtime_env: dict[str, Any] | None = None
    workdir: str = "/tmp/staleflow-ray"  # logs and PS data on each node (<workdir>/<run name>/)


class RunCfg(_Strict):
    name: str
    steps: Annotated[int, Field(ge=1)] = 100
    batch_size: Annotated[int, Field(ge=1)] = 8
    group_size: Annotated[int, Field(ge=1)] = 4
    eta: Annotated[int, Field(ge=0)] = 1
    dapo_filter: bool = False
    max_response_tokens: int = 1024
    max_prompt_tokens: int = 1024
    task: Literal["sim", "repeat"] = "sim"  # where the prompts come from
    prompts: int | None = None  # default: 2 x steps x batch_size
    seed: int = 0
    model: dict[str, Any] | None = None  # --model-config of the torch trainer and rollout workers
    database_url: str | None = None  # default: $STALEFLOW_DATABASE_URL


class RoleCfg(_Strict):
    replicas: Annotated[int, Field(ge=0)] = 1
    num_cpus: Annotated[float, Field(ge=0)] = 1.0
    num_gpus: Annotated[float, Field(ge=0)] = 0.0  # per tensor-parallel rank
    tensor_parallel: Annotated[int, Field(ge=1)] = 1
    resources: dict[str, float] = {}  # custom Ray resources: where the role may run
    spread: bool = False  # place replicas on different nodes where possible
    max_restarts: int | None = None  # default: [ray] max_restarts
    args: list[str] = []  # extra arguments of the role's staleflow command
    env: dict[str, str] = {}


class EngineRoleCfg(RoleCfg):
    engine: Literal["sim", "torch", "vllm"] = "sim"


class RewardCfg(RoleCfg):
    verifier: str = "sim"


# Each role's default replica count holds when its section sets other fields only.
class ApiCfg(RoleCfg):
    replicas: Annotated[int, Field(ge=1)] = 2


class CoordinatorCfg(RoleCfg):
    replicas: Annotated[int, Field(ge=0)] = 2  # leader and standby (the leader epoch in the database decides)


class PsCfg(RoleCfg):
    replicas: Annotated[int, Field(ge=0, le=1)] = 0  # needed by the torch and vllm engines


class TrainerCfg(EngineRoleCfg):
    replicas: Annotated[int, Field(ge=0, le=1)] = 1
    engine: Literal["sim", "torch"] = "sim"


class RolloutCfg(EngineRoleCfg):
    replicas: Annotated[int, Field(ge=0)] = 2  # one actor per inference instance
    # vllm: vLLM's engine arguments (AsyncEngineArgs fields), passed as --engine-arg; its
    # tensor_parallel_size defaults to `tensor_parallel` (the GPUs each instance is given)
    engine_args: dict[str, str | int | float | bool] = {}

    def engine_argv(self) -> list[str]:
        if self.engine != "vllm":
            return []
        args = dict(self.engine_args)
        if self.tensor_parallel > 1:
            args.setdefault("tensor_parallel_size", self.tensor_parallel)
        return [a for k, v in args.items() for a in ("--engine-arg", f"{k}={_toml_scalar(v)}")]


def _toml_scalar(v: str | int | float | bool) -> str:
    """The TOML text of a scalar, as --engine-arg parses it back."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return json.dumps(v) if isinstance(v, str) else repr(v)


class PlacementCfg(_Strict):
    roles: list[str]
    strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"


class LaunchConfig(_Strict):
    ray: RayCfg = RayCfg()
    run: RunCfg
    env: dict[str, str] = {}  # for every role
    api: ApiCfg = ApiCfg()
    coordinator: CoordinatorCfg = CoordinatorCfg()
    ps: PsCfg = PsCfg()
    trainer: TrainerCfg = TrainerCfg()
    reward: RewardCfg = RewardCfg()
    rollout: RolloutCfg = RolloutCfg()
    placement_groups: list[PlacementCfg] = []

    def role(self, name: str) -> RoleCfg:
        return getattr(self, name)

    def actor_name(self, role: str, i: int) -> str:
        return f"{self.run.name}.{role}-{i}"

    def names(self, role: str) -> list[str]:
        return [self.actor_name(role, i) for i in range(self.role(role).replicas)]

    def pg_name(self, k: int) -> str:
        return f"{self.run.name}.pg-{k}"

    def check(self) -> None:
        problems = []
        for k, pg in enumerate(self.placement_groups):
            problems += [f"placement_groups[{k}]: unknown role {r!r}" for r in pg.roles if r not in ROLES]
        grouped = [r for pg in self.placement_groups for r in pg.roles]
        problems += [f"role {r!r} is in two placement groups" for r in set(grouped) if grouped.count(r) > 1]
        torchy = self.trainer.engine != "sim" or self.rollout.engine != "sim"
        if torchy and self.ps.replicas != 1:
            problems.append("torch/vllm engines pull weights from a parameter server: set [ps] replicas = 1")
        problems += self._engine_problems()
        if problems:
            raise typer.BadParameter("; ".join(problems), param_hint="--config")

    def _engine_problems(self) -> list[str]:
        """[rollout] engine_args: vllm only, known AsyncEngineArgs fields (checked here on the
        launcher, before any actor starts), a tensor_parallel_size agreeing with tensor_parallel."""
        from workers.rollout.engines.engine_config import EngineConfigError, check_vllm

        ro = self.rollout
        if not ro.engine_args:
            return []
        if ro.engine != "vllm":
            return [f"[rollout] engine_args apply to the vllm engine, not {ro.engine}"]
        try:
            check_vllm(ro.engine_args)
        except EngineConfigError as e:
            return [f"[rollout] engine_args: {e}"]
        tp = ro.engine_args.get("tensor_parallel_size", ro.tensor_parallel)
        if tp != ro.tensor_parallel:
            return [
                f"[rollout] engine_args tensor_parallel_size = {tp!r} but tensor_parallel = {ro.tensor_parallel} "
                "(the GPUs Ray gives each instance): set them equal"
            ]
        return []


def load_config(path: Path) -> LaunchConfig:
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml  # comes with ray

        data = yaml.safe_load(text)
    else:
        data = tomllib.loads(text)
    cfg = LaunchConfig.model_validate(data)
    cfg.check()
    return cfg


# ---- the pieces ---------------------------------------------------------------------------


def actor_resources(cfg: RoleCfg) -> dict[str, Any]:
    """Ray options: CPUs, GPUs x tensor parallel size, custom resources."""
    return {"num_cpus": cfg.num_cpus, "num_gpus": cfg.num_gpus * cfg.tensor_parallel, "resources": dict(cfg.resources)}


def _bundle(cfg: RoleCfg) -> dict[str, float]:
    r = actor_resources(cfg)
    bundle = {"CPU": r["num_cpus"], "GPU": r["num_gpus"], **r["resources"]}
    return {k: v for k, v in bundle.items() if v > 0}


def _argv(cfg: LaunchConfig, role: str, i: int, run_id: int, workdir: str) -> list[str]:
    run = ["--run", str(run_id)]
    mc = ["--model-config", json.dumps(cfg.run.model)] if cfg.run.model else []
    if role == "api":
        argv = ["serve", "--no-upgrade"]
    elif role == "ps":
        argv = ["ps", *run, "--data-dir", f"{workdir}/ps"]
    elif role == "coordinator":
        argv = ["coordinator", *run]
    elif role == "reward":
        argv = ["reward-worker", *run, "--verifier", cfg.reward.verifier]
    elif role == "trainer":
        argv = ["trainer", *run, "--sim"] if cfg.trainer.engine == "sim" else ["trainer", *run, *mc]
    else:
        argv = ["rollout-worker", *run, "--engine", cfg.rollout.engine, "--name", cfg.actor_name(role, i)]
        argv += mc if cfg.rollout.engine != "sim" else []
        argv += cfg.rollout.engine_argv()
    return argv + cfg.role(role).args


def database_url(cfg: LaunchConfig) -> str:
    url = cfg.run.database_url or os.environ.get("STALEFLOW_DATABASE_URL")
    if not url:
        raise typer.BadParameter(
            "a Ray run needs a PostgreSQL every node reaches: set [run] database_url or "
            "STALEFLOW_DATABASE_URL (the embedded server is for one machine)",
            param_hint="--config",
        )
    return url


def prepare_run(cfg: LaunchConfig, url: str) -> tuple[int, dict[str, str], bool]:
    """Migrate, create the run (or find it: a second launch resumes) with its prompts, and
    issue one token per role; also whether the run already has its steps."""
    from api.auth import create_token
    from staleflow_db import migrate
    from staleflow_db.audit import find_run
    from staleflow_db.db import make_engine
    from staleflow_db.errors import NotFound
    from staleflow_db.protocol import Prompt, Protocol
    from staleflow_db.types import RunConfig

    migrate.upgrade(url)
    engine = make_engine(url)
    try:
        try:
            run_id = find_run(engine, cfg.run.name)
        except NotFound:
            r = cfg.run
            protocol = Protocol(engine)
            run_id = protocol.create_run(
                r.name,
                RunConfig(
                    batch_size=r.batch_size,
                    group_size=r.group_size,
                    eta=r.eta,
                    dapo_filter=r.dapo_filter,
                    max_response_tokens=r.max_response_tokens,
                    max_prompt_tokens=r.max_prompt_tokens,
                ),
            )
            protocol.enqueue(run_id, [Prompt(k, t, m) for k, t, m in _prompts(cfg)])
        complete = Protocol(engine).reads.status(run_id)["version"] >= cfg.run.steps
        tokens = {role: create_token(engine, role, run_id)["token"] for role in ("trainer", "rollout", "reward")}
        tokens["admin"] = create_token(engine, "admin", None, name=f"launch ray {cfg.run.name}")["token"]
    finally:
        engine.dispose()
    return run_id, tokens, complete


def _prompts(cfg: LaunchConfig) -> list[tuple[str, list[int], dict]]:
    r = cfg.run
    n = r.prompts or 2 * r.steps * r.batch_size  # filtered groups are replaced, work in flight spills over
    if r.task == "repeat":
        from workers.tasks.repeat import RepeatTask

        return RepeatTask().prompts(n, seed=r.seed, prefix=r.name)
    from workers.rollout.engines.sim_engine import encode_prompt

    return [(f"{r.name}-{k}", encode_prompt(16, 24, 0.3), {}) for k in range(n)]


# ---- start, follow, stop ----------------------------------------------------------------------


def connect(cfg: LaunchConfig) -> Any:
    import ray

    # It warns that removing a placement group kills its actors: that is what --stop does.
    logging.getLogger("ray.actor").setLevel(logging.ERROR)
    if not ray.is_initialized():
        ray.init(
            address=cfg.ray.address,
            namespace=cfg.ray.namespace,
            runtime_env=cfg.ray.runtime_env,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
    return ray


def running(cfg: LaunchConfig) -> list[str]:
    """The run's actors that exist now."""
    ray = connect(cfg)
    prefix = f"{cfg.run.name}."
    return sorted(n for n in ray.util.list_named_actors() if n.startswith(prefix))


def start(cfg: LaunchConfig) -> tuple[int, str]:
    """Create the run's actors (placement groups first); return the run id and the admin token."""
    ray = connect(cfg)
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from staleflow_cli.ray_actor import RoleProcess

    url = database_url(cfg)
    run_id, tokens, complete = prepare_run(cfg, url)
    if running(cfg):
        console.print(f"run {cfg.run.name} is already running on this cluster; following it")
        return run_id, tokens["admin"]
    if complete:
        console.print(f"run {cfg.run.name} already has its {cfg.run.steps} steps: nothing to start")
        return run_id, tokens["admin"]
    workdir = f"{cfg.ray.workdir}/{cfg.run.name}"
    strategies: dict[tuple[str, int], Any] = {}
    for k, pg_cfg in enumerate(cfg.placement_groups):
        members = [(role, i) for role in pg_cfg.roles for i in range(cfg.role(role).replicas)]
        pg = placement_group(
            [_bundle(cfg.role(role)) for role, _ in members],
            strategy=pg_cfg.strategy,
            name=cfg.pg_name(k),
            lifetime="detached",
        )
        if not pg.wait(120):
            raise typer.BadParameter(f"placement group {pg_cfg.roles} cannot be placed on this cluster")
        for b, member in enumerate(members):
            strategies[member] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b)
    actor_cls = ray.remote(RoleProcess)
    # the PS fetches the run's keys with the trainer's token (docs/security.md)
    role_token = {"ps": "trainer", "trainer": "trainer", "rollout": "rollout", "reward": "reward"}
    for role in ROLES:
        rc = cfg.role(role)
        needs_ps = role in ("trainer", "rollout") and getattr(rc, "engine", "sim") != "sim"
        for i in range(rc.replicas):
            env = {**cfg.env, "STALEFLOW_DATABASE_URL": url, **rc.env}
            if role in role_token:
                env["STALEFLOW_TOKEN"] = tokens[role_token[role]]
            spec = {
                "name": cfg.actor_name(role, i),
                "kind": role if role in ("api", "ps") else "worker",
                "argv": _argv(cfg, role, i, run_id, workdir),
                "env": env,
                "logdir": f"{workdir}/logs",
                "namespace": cfg.ray.namespace,
                "api": cfg.names("api") if role in role_token else [],
                "ps": cfg.actor_name("ps", 0) if needs_ps else None,
            }
            placement = strategies.get((role, i)) or ("SPREAD" if rc.spread else "DEFAULT")
            actor_cls.options(
                name=spec["name"],
                lifetime="detached",
                max_restarts=cfg.ray.max_restarts if rc.max_restarts is None else rc.max_restarts,
                max_task_retries=-1,  # calls wait for a restarting actor instead of failing
                max_concurrency=8,  # address() waits; info() and stop() must not queue behind it
                scheduling_strategy=placement,
                **actor_resources(rc),
            ).remote(spec)
    console.print(
        f"run {cfg.run.name} (id {run_id}): {len(running(cfg))} actors started; logs in {workdir}/logs on their nodes",
        soft_wrap=True,
    )
    return run_id, tokens["admin"]


def _handles(cfg: LaunchConfig, names: list[str]) -> dict[str, Any]:
    """Handles of those of the named actors that still exist."""
    ray = connect(cfg)
    found = {}
    for n in names:
        try:
            found[n] = ray.get_actor(n)
        except ValueError:
            pass  # killed since it was listed
    return found


def actors_info(cfg: LaunchConfig, timeout: float = 10.0) -> dict[str, dict[str, Any]]:
    """info() of every actor of the run that answers within `timeout`."""
    ray = connect(cfg)
    handles = _handles(cfg, running(cfg))
    refs = {n: h.info.remote() for n, h in handles.items()}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
    done = set(ready)
    return {n: ray.get(r) for n, r in refs.items() if r in done}


def api_urls(cfg: LaunchConfig, timeout: float = 180.0) -> list[str]:
    ray = connect(cfg)
    refs = [h.address.remote(timeout) for h in _handles(cfg, cfg.names("api")).values()]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout + 10)
    return [u for u in ray.get(ready) if u]


def follow(cfg: LaunchConfig, run_id: int, token: str, timeout: float | None = None) -> None:
    """Print progress (steps trained, from the API) until the run has `steps` versions."""
    from workers.client import StaleFlowClient

    urls = api_urls(cfg)
    if not urls:
        raise RuntimeError("no API replica became ready")
    client = StaleFlowClient(urls, token, retry_for=None)
    deadline = None if timeout is None else time.monotonic() + timeout
    last, shown_at = "", 0.0
    while True:
        status = client.run_status(run_id)
        samples = status.samples
        line = (
            f"run {cfg.run.name}: step {min(status.version, cfg.run.steps)}/{cfg.run.steps}, "
            f"{samples.get('running', 0)} running, {samples.get('queued', 0)} queued, "
            f"{status.active_instances} rollout instances"
        )
        if line != last or time.monotonic() - shown_at > 30:
            console.print(line, markup=False, highlight=False)
            last, shown_at = line, time.monotonic()
        if status.version >= cfg.run.steps:
            return
        if deadline is not None and time.monotonic() > deadline:
            raise RuntimeError(f"only {status.version} of {cfg.run.steps} steps within {timeout:.0f}s")
        time.sleep(1.0)


def stop(cfg: LaunchConfig, timeout: float = 30.0) -> int:
    """Stop the run's processes (SIGTERM, role by role, the API last), kill their actors and
    remove the placement groups; return how many actors there were."""
    ray = connect(cfg)
    names = running(cfg)
    for role in STOP_ORDER:
        handles = list(_handles(cfg, [n for n in names if n.startswith(f"{cfg.run.name}.{role}-")]).values())
        refs = [h.stop.remote(timeout) for h in handles]
        ray.wait(refs, num_returns=len(refs), timeout=timeout + 10)
        for h in handles:
            ray.kill(h, no_restart=True)
    for k in range(len(cfg.placement_groups)):
        try:
            ray.util.remove_placement_group(ray.util.get_placement_group(cfg.pg_name(k)))
        except ValueError:
            pass  # never created, or already removed
    return len(names)


def audit_line(cfg: LaunchConfig, run_id: int) -> tuple[str, bool]:
    from staleflow_db.audit import summary
    from staleflow_db.db import make_engine

    engine = make_engine(database_url(cfg))
    try:
        data = summary(engine, run_id)
    finally:
        engine.dispose()
    drops = ", ".join(f"{d['reason']} {d['samples']}" for d in data["drops"]) or "none"
    n = len(data["violations"])
    return f"run {cfg.run.name}: version {data['version']}; dropped: {drops}; staleness_violations: {n}", n == 0


# ---- the command ------------------------------------------------------------------------------

app = typer.Typer(help="Start StaleFlow on an existing cluster.", no_args_is_help=True)


@app.command("ray")
def launch_ray(
    config: Path = typer.Option(..., "--config", exists=True, dir_okay=False, help="run.toml (or .yaml)"),
    stop_: bool = typer.Option(False, "--stop", help="stop the run's actors and exit"),
    detach: bool = typer.Option(False, "--detach", help="start and return; the run goes on"),
    timeout: float | None = typer.Option(None, "--timeout", min=1.0, help="give up following after this long"),
) -> None:
    """Start a whole run on a Ray cluster, follow it to its last step, then stop it cleanly.
    Ctrl-C leaves it running (stop it with --stop)."""
    need("ray")
    cfg = load_config(config)
    if stop_:
        n = stop(cfg)
        console.print(f"run {cfg.run.name}: {n} actors stopped" if n else f"run {cfg.run.name}: nothing running")
        return
    run_id, token = start(cfg)
    if detach:
        return
    try:
        follow(cfg, run_id, token, timeout)
    except KeyboardInterrupt:
        console.print(f"still running; stop it with: staleflow launch ray --stop --config {config}")
        raise typer.Exit(130) from None
    except RuntimeError as e:
        console.print(f"[red]{e}[/red]; stopping")
        stop(cfg)
        raise typer.Exit(1) from None
    stop(cfg)
    line, clean = audit_line(cfg, run_id)
    console.print(line, markup=False, highlight=False)
    if not clean:
        raise typer.Exit(1)
