"""``staleflow coordinator --run RUN``: the run's coordinator (leader or standby)."""

from __future__ import annotations

import gc
import logging
import signal
import time

import typer

from staleflow_db.audit import find_run
from staleflow_db.db import make_engine
from staleflow_db.errors import NotFound
from staleflow_db.protocol import Protocol
from staleflow_db.retry import DATABASE_OUTAGE, is_db_unavailable
from workers.coordinator.cost_model import get_cost_model
from workers.coordinator.policies import POLICY_NAMES, TUNABLE, get_policy
from workers.coordinator.service import Coordinator
from workers.retry import Outage
from workers.settings import coordinator_settings

log = logging.getLogger("staleflow.coordinator")


def _overrides(params: list[str]) -> dict[str, float]:
    out = {}
    for p in params:
        key, sep, value = p.partition("=")
        if not sep or key not in TUNABLE:
            raise typer.BadParameter(
                f"{p!r}: expected NAME=VALUE with NAME in {', '.join(TUNABLE)}", param_hint="--set"
            )
        try:
            out[key] = float(value) if "." in value or "e" in value else int(value)
        except ValueError:
            raise typer.BadParameter(f"{p!r}: {value!r} is not a number", param_hint="--set") from None
    return out


def coordinator(
    run: str = typer.Option(..., "--run", help="Run id or name."),
    policy: str = typer.Option(
        None, help=f"One of: {', '.join(POLICY_NAMES)} (default: $STALEFLOW_COORDINATOR_POLICY, else staleflow)."
    ),
    model: str = typer.Option(None, help="Cost model, a key of cost_models.json (default: qwen_7b)."),
    parallelism: str = typer.Option(None, help="The fit to use, e.g. TP1_PP1 or TP2_PP1 (default: TP1_PP1)."),
    period: float = typer.Option(None, help="Seconds between cycles (default: the policy's, 0.1)."),
    lease: float = typer.Option(None, help="Leader lease in seconds; a standby takes over after it lapses (3)."),
    duration: float = typer.Option(None, help="Stop after this many seconds (default: until SIGTERM)."),
    ps_streams: int = typer.Option(
        None, min=1, help="Pulls the parameter server carries at full rate at once; unset: pulls not staggered."
    ),
    set_: list[str] = typer.Option([], "--set", help="Policy parameter override NAME=VALUE (repeatable)."),
) -> None:
    """Route, pull and migrate for one run: snapshot -> speculative state -> commands, every cycle.
    Options left out come from STALEFLOW_COORDINATOR_* (docs/settings.md)."""
    env = coordinator_settings()
    policy = policy or env.policy
    model = model or env.model
    parallelism = parallelism or env.parallelism
    period = env.period if period is None else period
    lease = env.lease if lease is None else lease
    ps_streams = env.ps_streams if ps_streams is None else ps_streams
    if policy not in POLICY_NAMES:
        raise typer.BadParameter(f"unknown policy {policy!r}; known: {', '.join(POLICY_NAMES)}", param_hint="--policy")
    try:
        cost = get_cost_model(model, parallelism)
    except KeyError as e:
        raise typer.BadParameter(str(e), param_hint="--model") from None
    chosen = get_policy(policy, **_overrides(set_))
    # No pre-ping: it cost a round trip per checkout, six a cycle, three of them (snapshot, write,
    # wake-up) between the snapshot and the commands' delivery. A pooled connection that died
    # (a database restart) fails its first statement instead; SQLAlchemy then invalidates the
    # whole pool, and the cycle is retried as through any outage (`Coordinator._lead_and_cycle`).
    engine = make_engine(pool_pre_ping=False)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    # Started while the database is down: wait for it (one line now, one when it is back).
    waiting = Outage("the database", log)
    try:
        for attempt in DATABASE_OUTAGE.retrying(waiting, stopping=lambda: bool(stopping)):
            with attempt:
                run_id = find_run(engine, run)
        waiting.ok()
    except NotFound as e:
        raise typer.BadParameter(str(e), param_hint="--run") from None
    except Exception as e:
        if stopping and is_db_unavailable(e):
            log.info("stopped while waiting for the database")
            return
        raise
    service = Coordinator(
        Protocol(engine), run_id, chosen, cost, lease_s=lease, period_s=period, pull_streams=ps_streams
    )
    signal.signal(signal.SIGTERM, lambda *_: service.stop())
    started = time.monotonic()
    last = [started]

    def until() -> bool:
        now = time.monotonic()
        if now - last[0] >= 5:
            last[0] = now
            s = service.stats
            ms = sorted(list(s.cycle_ms)[-200:]) or [0.0]
            log.info(
                "%s epoch %s: %d cycles, routed %d (refused %d), pulls %d, interrupts %d; cycle p50 %.1f ms;"
                " database outages %d",
                "leader" if service.epoch else "standby",
                service.epoch,
                s.cycles,
                s.routed,
                s.refused,
                s.pulled,
                s.interrupted,
                ms[len(ms) // 2],
                s.outages,
            )
        return duration is not None and now - started >= duration

    log.info("coordinator %s for run %s, policy %s", service.holder, run_id, chosen.name)
    # The start-up heap (modules, SQLAlchemy, numpy) into the permanent generation: the
    # collections that fall inside a cycle, on its decisions' path, then scan what cycles
    # allocate instead of the whole heap.
    gc.freeze()
    try:
        service.run(until)
    finally:
        engine.dispose()
