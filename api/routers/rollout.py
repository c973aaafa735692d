"""Rollout instances: register, heartbeat (with the snapshot), long-poll for work and commands,
report segments, deregister."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from sqlalchemy import Connection
from starlette.concurrency import run_in_threadpool

from staleflow_db import group_commit
from staleflow_db.protocol.rollout import Poll
from staleflow_db.types import Report
from workers.wire.enums import Role, SegmentKind
from workers.wire.models import (
    DeregisterOut,
    DropsOut,
    HeartbeatIn,
    HeartbeatOut,
    PollOut,
    RegisterIn,
    RegisterOut,
    ReportIn,
    ReportsIn,
    ReportsOut,
    TrajectoryDropsIn,
    errors,
)
from workers.wire.models.common import Limit

from ..auth import Principal
from ..body import ModelBodyRoute
from ..deps import IdempotencyKey, InstanceId, RunId, State, Wait, allow_run, long_poll
from ..errors import error_body
from ..notify import BATCH, REWARDS, WORK, instance_topic
from ..service import dump, respond, respond_json, scoped_key

router = APIRouter(
    route_class=ModelBodyRoute, prefix="/v1/runs/{run_id}", tags=["rollout"], responses=errors(401, 403, 404, 422, 503)
)
Rollout = Depends(allow_run(Role.ROLLOUT))


@router.post("/instances", status_code=201, response_model=RegisterOut)
def register(
    run_id: RunId,
    body: RegisterIn,
    state: State,
    key: IdempotencyKey = None,
    who: Principal = Rollout,
) -> RegisterOut:
    """Register a rollout instance: a new id for every process start (send an Idempotency-Key
    so a retried registration does not leave a second instance behind)."""

    def call(conn: Connection) -> RegisterOut:
        iid = state.protocol.register_instance(
            run_id,
            body.name,
            body.version,
            body.lease_seconds,
            who.token_id,
            capacity=body.capacity.model_dump() if body.capacity is not None else None,
            conn=conn,
        )
        return RegisterOut(instance_id=iid, run_id=run_id, lease_seconds=body.lease_seconds)

    # The key is the token's own: another token's retry must not be handed this instance.
    out, _ = state.protocol.once(scoped_key(key, f"run{run_id}:tok{who.token_id}"), "register", body, call, RegisterOut)
    return out


@router.post("/instances/{instance_id}/heartbeat", response_model=HeartbeatOut, responses=errors(409))
def heartbeat(
    run_id: RunId,
    instance_id: InstanceId,
    body: HeartbeatIn,
    state: State,
    who: Principal = Rollout,
) -> Response:
    """Extend the instance lease and store the snapshot. 409: the lease expired (register again).
    Any poll or report of the instance extends the lease too: a busy instance heartbeats only
    when its snapshot changed and no report carried it."""
    state.instance_in_run(run_id, instance_id, who)
    snapshot = body.snapshot.model_dump()

    def call(conn: Connection | None) -> None:
        state.protocol.heartbeat(instance_id, body.version, snapshot, body.lease_seconds, conn=conn)

    state.writes.write("heartbeat", call, group_commit.lease(instance_id), ephemeral=True)
    return respond(HeartbeatOut(instance_id=instance_id, lease_seconds=body.lease_seconds))


@router.delete("/instances/{instance_id}", response_model=DeregisterOut)
def deregister(run_id: RunId, instance_id: InstanceId, state: State, who: Principal = Rollout) -> DeregisterOut:
    """Clean shutdown: the instance's running samples go back to the queue with their tokens,
    and a long-poll of the instance still open is answered at once (409: the instance is gone)."""
    state.instance_in_run(run_id, instance_id, who)
    out = DeregisterOut(instance_id=instance_id, requeued=state.protocol.deregister_instance(instance_id))
    # its open long-poll answers now (409), not at its timeout
    state.notifier.publish(run_id, instance_topic(instance_id))
    return out


@router.post("/instances/{instance_id}/poll", response_model=PollOut, responses=errors(409))
async def poll(
    request: Request,
    run_id: RunId,
    instance_id: InstanceId,
    state: State,
    key: IdempotencyKey = None,
    wait: Wait = 0.0,
    limit: Limit = 1000,
    who: Principal = Rollout,
) -> Response:
    """Long-poll (it renews the instance's lease): one reply shape, `work` (newly routed samples, with the tokens and log-probs
    to continue from) and `commands` (interrupt, abort, pull), each empty when there is none.
    Returns as soon as either part has something, or both empty after `wait` seconds. Delivery is once: send an Idempotency-Key so a retry after a lost response
    gets the same delivery back."""
    if instance_id in state.instance_owners:  # cached: a check without I/O, no thread hand-off
        state.instance_in_run(run_id, instance_id, who)
    else:
        await run_in_threadpool(state.instance_in_run, run_id, instance_id, who)
    skey = scoped_key(key, f"inst{instance_id}")

    def call(conn: Connection) -> bytes:
        return dump(Poll, state.protocol.poll_work(instance_id, limit, conn=conn))

    def idle(conn: Connection) -> bytes | None:
        # a re-check with nothing to deliver: one read in autocommit, no transaction
        return _EMPTY_POLL if state.protocol.poll_idle(instance_id, skey, conn=conn) else None

    def fetch(check_idle: bool = True) -> bytes:
        check = idle if check_idle else None
        return state.protocol.once_json(skey, "poll", None, call, PollOut, store=_nonempty, idle=check)[0]

    # the instance's topic wakes for its routes and commands only: after a wake, the transaction
    topic = instance_topic(instance_id)
    return respond_json(await long_poll(request, state, run_id, topic, wait, fetch, _nonempty, lambda: fetch(False)))


def reports_of(items: list[ReportIn], instance_id: int) -> list[Report]:
    """The data layer's reports of `instance_id` from the wire's."""
    return [
        Report(
            r.sample_id,
            r.attempt,
            r.version,
            r.tokens,
            r.logprobs,
            SegmentKind(r.kind),
            r.finish_reason,
            r.generated,
            instance_id=instance_id,
            route_token=str(r.route_token),
        )
        for r in items
    ]


# PollOut as the data layer's Poll (their fields are the same, nested)
_EMPTY_POLL = dump(Poll, Poll())


def _nonempty(out: bytes) -> bool:
    return out != _EMPTY_POLL


@router.post("/instances/{instance_id}/segments", response_model=ReportsOut, responses=errors(409, 413))
def report(
    run_id: RunId,
    instance_id: InstanceId,
    body: ReportsIn,
    state: State,
    key: IdempotencyKey = None,
    who: Principal = Rollout,
) -> Response:
    """Report segments (finished, interrupted or partial) of samples routed to this instance,
    each quoting the attempt and route token it was delivered with; a segment with
    `generated: false` is an environment observation (multi-turn: no version, loss mask 0). All or nothing: 409 naming
    the samples whose route this instance does not hold (another instance's sample, a stale
    attempt, a wrong route token, a sample no longer running) or, for every sample, when the
    instance itself is fenced (instance lease lapsed or expired: register again). A report
    renews the instance's lease as a heartbeat does; its `snapshot`, when sent, is stored as a
    heartbeat's (the version is the heartbeat's to change)."""
    state.instance_in_run(run_id, instance_id, who)
    reports = reports_of(body.reports, instance_id)
    snapshot = body.snapshot.model_dump() if body.snapshot is not None else None

    def call(conn: Connection) -> ReportsOut:
        return ReportsOut(applied=state.protocol.report(run_id, reports, snapshot=snapshot, conn=conn))

    skey = scoped_key(key, f"inst{instance_id}")
    out, replayed = state.writes.once(skey, "report", body, call, ReportsOut, group_commit.instance(instance_id))
    if not replayed and any(r.kind == SegmentKind.FINISHED for r in reports):
        state.notifier.publish(run_id, REWARDS)
    return respond(out)


@router.post("/instances/{instance_id}/drops", response_model=DropsOut, responses=errors(409, 413))
def drop_trajectories(
    run_id: RunId,
    instance_id: InstanceId,
    body: TrajectoryDropsIn,
    state: State,
    key: IdempotencyKey = None,
    who: Principal = Rollout,
) -> Response:
    """Give up on samples routed to this instance whose environment failed (`env_failed`) or
    hung (`env_timeout`): each is aborted with `reason`, fenced by its attempt and route token
    like a report (409 when the route or the instance's lease was lost; all or nothing). A
    group left with fewer than N live members is aborted too. A drop already done at that
    attempt is skipped, so a retry changes nothing. Like a report, it renews the lease."""
    state.instance_in_run(run_id, instance_id, who)
    drops = [(d.sample_id, d.attempt, str(d.route_token)) for d in body.drops]

    def call(conn: Connection) -> DropsOut:
        dropped = state.protocol.drop_trajectories(run_id, instance_id, drops, body.reason, conn=conn)
        return DropsOut(dropped=dropped)

    key_scope = scoped_key(key, f"inst{instance_id}")
    out, replayed = state.protocol.once(key_scope, "trajectory_drop", body, call, DropsOut)
    if not replayed and out.dropped:
        # a dropped group frees its reservation: rollout work and, through a cascade, batches
        state.notifier.publish(run_id, BATCH, WORK)
    return respond(out)


@router.post("/segments", status_code=410, response_model=None, deprecated=True, responses=errors(410))
def report_moved(run_id: RunId, who: Principal = Rollout) -> JSONResponse:
    """Gone: reports name their instance now (POST /v1/runs/{run_id}/instances/{instance_id}/segments,
    each report quoting the route token delivered with the work). Nothing is applied."""
    return JSONResponse(
        error_body(
            "gone",
            f"segments are reported at /v1/runs/{run_id}/instances/{{instance_id}}/segments, each report"
            " quoting the route token its work was delivered with; nothing was applied",
        ),
        status_code=410,
    )
