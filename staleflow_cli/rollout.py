"""``staleflow rollout-worker``: serve routed samples on one engine (docs in staleflow_cli/common.py)."""

from __future__ import annotations

import enum
import importlib
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from staleflow_cli.common import (
    API,
    API_WAIT,
    ENV_CODEC,
    HF_MODEL,
    MODEL_CONFIG,
    MODEL_SEED,
    RUN,
    TOKEN,
    connect,
    console,
    fail,
    hf_folder,
    model_config,
    on_signals,
    progress,
    ps_client,
    ps_login,
    run_sampling,
    torch_device,
)
from workers.client import StaleFlowClient
from workers.rollout.worker import CHECKPOINT_EVERY_S, CHECKPOINT_TOKENS, FINISH_SLACK_MAX_S

if TYPE_CHECKING:  # torch-backed or heavy: imported where used
    from workers.coordinator.cost_model import CostModel
    from workers.models.tiny_model import TinyConfig
    from workers.rollout.engines.base import Engine as BaseEngine
    from workers.rollout.worker import WeightSource
    from workers.trainer.param_client import ParamClient


class Engine(str, enum.Enum):
    torch = "torch"
    sim = "sim"
    vllm = "vllm"
    hf = "hf"


# ---- rollout worker ---------------------------------------------------------------------------


def rollout_worker(
    run: str = RUN,
    engine: Engine = typer.Option(
        ..., "--engine", help="torch (tiny model, CPU/GPU), hf (a Hugging Face model folder), sim (cost model) or vllm"
    ),
    api: list[str] | None = API,
    token: str | None = TOKEN,
    api_wait: float | None = API_WAIT,
    ps: str | None = typer.Option(None, "--ps", help="HOST:PORT of the PS to pull weights from"),
    name: str | None = typer.Option(None, "--name", help="instance label (default: host-pid)"),
    kv_capacity: int | None = typer.Option(
        None,
        "--kv-capacity",
        min=16,
        help="KV-cache tokens (torch, hf: default 8192; sim: the engine's) [STALEFLOW_ENGINE_KV_CAPACITY]",
    ),
    phi_wait: int | None = typer.Option(
        None,
        "--phi-wait",
        min=0,
        help="interrupt a preempted sample when more than this many wait [STALEFLOW_ENGINE_PHI_WAIT]",
    ),
    max_running: int | None = typer.Option(None, "--max-running", min=1, help="[STALEFLOW_ENGINE_MAX_RUNNING, 256]"),
    temperature: float | None = typer.Option(
        None,
        "--temperature",
        min=0.0,
        help="the run's temperature is used; a different one here is refused [STALEFLOW_ENGINE_TEMPERATURE]",
    ),
    model_config_: str | None = MODEL_CONFIG,
    model_seed: int = MODEL_SEED,
    model: Path | None = HF_MODEL,
    device: str | None = typer.Option(
        None, "--device", help="torch and hf engine device [STALEFLOW_ENGINE_DEVICE, cpu]"
    ),
    vllm_model: str | None = typer.Option(None, "--vllm-model", help="vllm: model name or path"),
    sim_model: str | None = typer.Option(None, "--sim-model", help="sim: cost model (cost_models.json), e.g. qwen_7b"),
    sim_parallelism: str | None = typer.Option(None, "--sim-parallelism", help="sim: e.g. TP1_PP1"),
    time_scale: float | None = typer.Option(
        None, "--time-scale", min=0.0, help="sim: wall seconds per simulated second"
    ),
    engine_config_: Path | None = typer.Option(
        None,
        "--engine-config",
        dir_okay=False,
        help="vllm, hf: a TOML file of engine arguments (vllm: any field of vLLM's AsyncEngineArgs, e.g. "
        "tensor_parallel_size, dtype, gpu_memory_utilization, max_model_len, enforce_eager; hf: dtype, device, "
        "max_model_len, max_num_seqs); its keys win over --max-running and --device",
    ),
    engine_arg: list[str] | None = typer.Option(
        None,
        "--engine-arg",
        help="vllm, hf: KEY=VALUE (a TOML scalar) on top of --engine-config; repeatable",
    ),
    env: str | None = typer.Option(
        None,
        "--env",
        help="multi-turn: an environment, module:ClassOrFactory (reset/step, docs/integration.md), "
        "stepped after each of the model's turns",
    ),
    codec: str | None = ENV_CODEC,
    env_timeout: float = typer.Option(
        10.0, "--env-timeout", min=0.01, help="seconds an environment call may take; then env_timeout drops it"
    ),
    heartbeat: float = typer.Option(
        1.0, "--heartbeat", min=0.05, help="least seconds between two snapshots (polls and reports renew the lease)"
    ),
    checkpoint_tokens: int = typer.Option(
        CHECKPOINT_TOKENS,
        "--checkpoint-tokens",
        min=0,
        help="a held sample's unsent tokens that make a checkpoint (a partial segment) due: what a killed "
        "worker loses at most per sample (up to ~496 a checkpoint's row fits two to a database page); 0: time only",
    ),
    finish_slack: float = typer.Option(
        FINISH_SLACK_MAX_S,
        "--finish-slack",
        min=0.0,
        help="most seconds a finished sample's report waits for others to share its call (at most 1% of the "
        "sample's decode time); 0: at the report timer",
    ),
    checkpoint_every: float = typer.Option(
        CHECKPOINT_EVERY_S,
        "--checkpoint-every",
        min=0.0,
        help="seconds after which a checkpoint is due whatever the tokens; 0: tokens only",
    ),
    ps_wait: float = typer.Option(120.0, "--ps-wait", min=0.0, help="seconds to wait for the PS's first version"),
    instances: int = typer.Option(
        1,
        "--instances",
        min=1,
        max=60,
        help="sim: engine instances this process drives (a node), their reports, heartbeats and polls "
        "sent together (one sync call per flush and one long-poll for all)",
    ),
    pull_bucket_mb: float = typer.Option(
        256.0,
        "--pull-bucket-mb",
        min=0.001,
        help="MiB a weight pull holds at a time (per GPU): weights stream into the engine in buckets of this size",
    ),
) -> None:
    """Serve routed samples on one engine; report segments; pull weights when told."""
    from workers.rollout.worker import RolloutWorker
    from workers.settings import engine_settings

    es = engine_settings()  # options left out come from STALEFLOW_ENGINE_*
    kv_capacity = kv_capacity if kv_capacity is not None else es.kv_capacity
    phi_wait = phi_wait if phi_wait is not None else es.phi_wait
    max_running = max_running if max_running is not None else es.max_running
    temperature = temperature if temperature is not None else es.temperature  # None: the run's
    device = device if device is not None else es.device
    engine_kw = _engine_kwargs(engine, engine_config_, engine_arg or [])  # checked before any model loads
    if engine in (Engine.torch, Engine.hf):
        torch_device(str(engine_kw.get("device", device)), "--device" if "device" not in engine_kw else "--engine-arg")
    cfg = model_config(model_config_) if engine is Engine.torch else None
    if engine is Engine.vllm and not (vllm_model or model):
        raise typer.BadParameter("--engine vllm needs --vllm-model (or --model FOLDER)", param_hint="--vllm-model")
    if engine is Engine.hf:
        if model is None:
            raise typer.BadParameter("--engine hf needs --model", param_hint="--model")
        hf_folder(model)
    turns = None
    if env:
        from workers.envs.base import load_codec, load_env
        from workers.rollout.turns import Turns

        try:
            turns = Turns(load_env(env), load_codec(codec), env_timeout)
        except Exception as e:  # the user's module may fail to import in any way
            raise typer.BadParameter(f"{env}: {type(e).__name__}: {e}", param_hint="--env") from None
    if instances > 1 and engine is not Engine.sim:
        raise typer.BadParameter("several instances per process: the sim engine only", param_hint="--instances")
    cost = _cost_model(sim_model, sim_parallelism) if engine is Engine.sim else None
    pc = ps_client(ps)
    client, run_id = connect(api, token, run, api_wait)
    temperature, top_p = run_sampling(client, run_id, temperature)
    if top_p < 1 and engine in (Engine.torch, Engine.hf):
        raise fail(
            f"run {run_id} samples with top_p {top_p:g}: the {engine.value} engine samples the whole distribution (use --engine vllm)"
        )
    ps_login(pc, client, run_id, "rollout")
    weights: WeightSource | None
    if instances > 1:
        _node(
            client,
            run_id,
            instances,
            name,
            kv_capacity,
            max_running,
            cost,
            time_scale,
            phi_wait=phi_wait,
            heartbeat_s=heartbeat,
            finish_slack_max_s=finish_slack,
            checkpoint_tokens=checkpoint_tokens,
            checkpoint_every_s=checkpoint_every,
        )
        return
    if engine is Engine.sim:
        eng, weights = _sim_engine(client, run_id, kv_capacity, max_running, cost, time_scale)
    else:
        eng, weights = _engine(
            engine,
            pc,
            cfg,
            model_seed,
            kv_capacity or 8192,
            max_running,
            temperature,
            device,
            vllm_model or (str(model) if model else None),
            ps_wait,
            engine_kw,
            int(pull_bucket_mb * (1 << 20)),
            top_p=top_p,
        )
    worker = RolloutWorker(
        client,
        run_id,
        eng,
        name=name or f"{socket.gethostname()}-{os.getpid()}",
        weights=weights,
        phi_wait=phi_wait,
        heartbeat_s=heartbeat,
        finish_slack_max_s=finish_slack,
        checkpoint_tokens=checkpoint_tokens,
        checkpoint_every_s=checkpoint_every,
        turns=turns,
    )
    on_signals(worker.stop, "flushing reports and deregistering")
    with progress(None, f"rollout run {run_id}: starting") as (bar, task):
        last = [0.0]

        def show() -> bool:
            if time.monotonic() - last[0] >= 1.0:
                s = worker.stats
                bar.update(
                    task,
                    description=(
                        f"rollout {worker.instance_id} v{eng.version}: routed {s.routed} finished {s.finished} "
                        f"interrupted {s.interrupted} tokens {s.tokens} pulls {s.pulls}"
                        f"{' (API unavailable)' if client.api.down else ''}"
                    ),
                )
                last[0] = time.monotonic()
            return False

        try:
            stats = worker.run(until=show)
        finally:
            if hasattr(eng, "shutdown"):  # vLLM runs its engine core in another process
                eng.shutdown()
    console.print(f"rollout worker: {stats.finished} finished, {stats.tokens} tokens, deregistered")


def _node(
    client: StaleFlowClient,
    run_id: int,
    k: int,
    name: str | None,
    kv_capacity: int | None,
    max_running: int,
    cost: CostModel | None,
    time_scale: float | None,
    **worker_kw: Any,
) -> None:
    """`k` sim instances in this process (workers/rollout/node.py), each in its own thread;
    `worker_kw` goes to every instance's RolloutWorker."""
    import threading

    from workers.rollout.node import Node
    from workers.rollout.worker import RolloutWorker

    node = Node(client, run_id)
    base = name or f"{socket.gethostname()}-{os.getpid()}"
    workers = []
    for i in range(k):
        eng, weights = _sim_engine(client, run_id, kv_capacity, max_running, cost, time_scale)
        workers.append(
            RolloutWorker(
                client,
                run_id,
                eng,
                name=f"{base}-{i}",
                weights=weights,
                node=node,
                **worker_kw,
            )
        )

    def stop() -> None:
        for w in workers:
            w.stop()

    on_signals(stop, "flushing reports and deregistering")
    errors: list[BaseException] = []

    def serve(w: RolloutWorker) -> None:
        try:
            w.run()
        except BaseException as e:  # the others go on; the process fails at the end
            errors.append(e)
            console.print(f"[red]instance {w.instance_id}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=serve, args=(w,), name=f"instance-{i}") for i, w in enumerate(workers)]
    node.start()
    for t in threads:
        t.start()
    with progress(None, f"rollout node, run {run_id}, {k} instances: starting") as (bar, task):
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(1.0)
            bar.update(
                task,
                description=(
                    f"rollout node ({k} instances): finished {sum(w.stats.finished for w in workers)} "
                    f"tokens {sum(w.stats.tokens for w in workers)} syncs {node.calls['flush']} flush "
                    f"{node.calls['poll']} poll{' (API unavailable)' if client.api.down else ''}"
                ),
            )
    node.close()
    finished = sum(w.stats.finished for w in workers)
    console.print(f"rollout node: {k} instances, {finished} finished, {node.calls.total()} syncs, deregistered")
    if errors:
        raise typer.Exit(1)


def _engine_kwargs(engine: Engine, path: Path | None, args: list[str]) -> dict[str, Any]:
    """The engine arguments of --engine-config and --engine-arg, checked for `engine`."""
    from workers.rollout.engines import engine_config as ec

    if path is None and not args:
        return {}
    hint = "--engine-config" if path is not None else "--engine-arg"
    if engine not in (Engine.vllm, Engine.hf):
        raise typer.BadParameter(
            f"engine arguments apply to the vllm and hf engines, not {engine.value}", param_hint=hint
        )
    try:
        cfg = ec.engine_config(path, args)
        return ec.check_vllm(cfg) if engine is Engine.vllm else ec.hf_kwargs(cfg)
    except ec.EngineConfigError as e:
        raise typer.BadParameter(str(e), param_hint=hint) from None


def _cost_model(model: str | None, parallelism: str | None) -> CostModel | None:
    if model is None:
        return None  # the sim engine's default (STALEFLOW_SIM_MODEL, else qwen_7b)
    from workers.coordinator.cost_model import get_cost_model

    try:
        return get_cost_model(model, parallelism)
    except KeyError as e:
        raise typer.BadParameter(str(e.args[0]), param_hint="--sim-model") from None


def _sim_engine(
    client: StaleFlowClient,
    run_id: int,
    kv_capacity: int | None,
    max_running: int,
    cost: CostModel | None,
    time_scale: float | None,
) -> tuple[BaseEngine, WeightSource]:
    """The cost-model engine: no weights, so a pull only moves its version on."""
    try:
        mod = importlib.import_module("workers.rollout.engines.sim_engine")
    except ModuleNotFoundError as e:
        if e.name != "workers.rollout.engines.sim_engine":
            raise
        raise typer.BadParameter(
            "the sim engine (workers/rollout/engines/sim_engine.py) is not in this installation", param_hint="--engine"
        ) from None
    kw: dict[str, Any] = {
        "cost": cost,
        "max_running": max_running,
        "time_scale": time_scale,
        "version": client.run_status(run_id).version,
    }
    if kv_capacity is not None:
        kw["kv_capacity_tokens"] = kv_capacity
    eng = mod.SimEngine(**kw)
    return eng, lambda target: (None, target if target is not None else client.run_status(run_id).version)


def _engine(
    kind: Engine,
    pc: ParamClient | None,
    cfg: TinyConfig | None,
    model_seed: int,
    kv_capacity: int,
    max_running: int,
    temperature: float,
    device: str,
    model: str | None,
    ps_wait: float,
    engine_kw: dict[str, Any] | None = None,
    bucket_bytes: int | None = None,
    top_p: float = 1.0,
) -> tuple[BaseEngine, WeightSource | None]:
    """(engine, weight source) for the torch, hf and vllm engines (`model`: hf and vllm;
    `engine_kw`: their checked engine arguments, see _engine_kwargs)."""
    engine_kw = engine_kw or {}
    if kind is Engine.torch:
        from workers.rollout.engines.torch_engine import TorchEngine

        assert cfg is not None  # rollout_worker builds one for the torch engine
        eng: BaseEngine = TorchEngine(
            cfg,
            model_seed=model_seed,
            kv_capacity_tokens=kv_capacity,
            max_running=max_running,
            temperature=temperature,
            device=device,
        )
    elif kind is Engine.hf:
        from workers.rollout.engines.hf_engine import HFEngine

        assert model  # rollout_worker checks it
        hf_kw: dict[str, Any] = {"max_running": max_running, "device": device, **engine_kw}
        eng = HFEngine(model, kv_capacity_tokens=kv_capacity, temperature=temperature, **hf_kw)
    else:
        from workers.rollout.engines.vllm_engine import VLLMEngine, VLLMUnavailable

        assert model  # rollout_worker checks it
        try:
            from workers.rollout.engines.engine_config import vllm_kwargs

            eng = VLLMEngine(model, temperature=temperature, top_p=top_p, **vllm_kwargs(engine_kw, max_running))
        except VLLMUnavailable as e:
            raise fail(str(e)) from None
    if pc is None:
        console.print("[yellow]no --ps: serving the initial weights; pull commands change nothing")
        return eng, None
    # the engine pulls from the PS itself, streaming each version into its model in buckets
    # (vLLM: its workers do): no weights pass through this process
    from workers.trainer.param_store import ChecksumError, ParamServerError

    where = f"{pc.addr[0]}:{pc.addr[1]}"
    if kind is Engine.vllm:
        eng.ps_addr = where  # type: ignore[attr-defined]
        if pc.credentials is not None:
            eng.ps_credentials = [pc.credentials.run_id, pc.credentials.role, pc.credentials.key.hex()]  # type: ignore[attr-defined]
    else:
        eng.ps = pc  # type: ignore[attr-defined]  # the torch and hf engines
    eng.bucket_bytes = bucket_bytes
    with console.status(f"loading the latest committed version from the PS at {where}"):
        try:
            eng.load_from_ps(None, wait_s=ps_wait)
        except ParamServerError as e:
            if isinstance(e, ChecksumError):
                raise
            raise fail(
                f"the PS at {where} served no committed version within {ps_wait:.0f}s "
                f"(the trainer pushes and commits version 0 when it starts): {e}"
            ) from None
    return eng, eng.weight_source
