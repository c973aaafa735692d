"""The coordinator's door: one-transaction snapshot, routes (Reserve), commands, aborts, expiry.

Writes may carry the coordinator's leadership `epoch`; it is checked against the run's leader epoch in
the same transaction, so a deposed leader cannot route or interrupt (ENGINEERING pattern 9).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query
from fastapi.responses import JSONResponse, Response
from pydantic_core import to_json
from sqlalchemy import Connection
from typing_extensions import TypedDict

from staleflow_db.protocol.coordination import QueuedView
from staleflow_db.types import RouteResult
from workers.wire.enums import Role
from workers.wire.models import (
    AbortedOut,
    AbortGroupIn,
    AbortGroupOut,
    AbortSamplesIn,
    ClusterSnapshotOut,
    CommandsOut,
    DroppedGroupsOut,
    ExpireOut,
    InstanceViewOut,
    InterruptIn,
    PullIn,
    QueuedSampleOut,
    RouteIn,
    RouteOut,
    RouteResultOut,
    SnapshotBufferOut,
    SnapshotChangesOut,
    errors,
)
from workers.wire.snapshot_mirror import FIELDS
from workers.wire.types import RouteOutcome

from ..auth import Principal
from ..body import ModelBodyRoute
from ..deps import IdempotencyKey, RunId, State, allow_run
from ..errors import error_body
from ..notify import BATCH, WORK, instance_topic
from ..service import dump, respond_json, scoped_key, unpublished

router = APIRouter(
    route_class=ModelBodyRoute,
    prefix="/v1/runs/{run_id}",
    tags=["coordinator"],
    responses=errors(401, 403, 404, 422, 503),
)
Coordinator = Depends(allow_run(Role.COORDINATOR))


@router.get("/snapshot", response_model=ClusterSnapshotOut)
def snapshot(
    run_id: RunId, state: State, who: Principal = Depends(allow_run(Role.COORDINATOR, Role.OBSERVER))
) -> Response:
    """Active instances with their latest snapshots and running samples, queued samples with
    lengths, unconsumed buffers, from one repeatable-read transaction."""
    snap = state.protocol.snapshot(run_id)
    # The queued samples (thousands) go out as the data layer's dataclasses, serialised
    # without a model per sample; the few instances and buffers are validated as models.
    body: _SnapshotJson = {
        "run_id": snap.run_id,
        "version": snap.version,
        "config": snap.config.as_dict(),
        "buffers": [
            SnapshotBufferOut(index=i, occupied=b.occupied, reserved=b.reserved)
            for i, b in sorted(snap.buffers.items())
        ],
        "instances": [
            InstanceViewOut.model_validate(
                {
                    "instance_id": i.id,
                    "name": i.name,
                    "version": i.version,
                    "snapshot": i.snapshot,
                    "snapshot_age_s": i.snapshot_age_s,
                    "running": [r._asdict() for r in i.running],
                }
            )
            for i in snap.instances
        ],
        "queued": snap.queued,
        "latest_params": snap.latest_params,
    }
    return respond_json(dump(_SnapshotJson, body, _SNAPSHOT_EXCLUDE))


@router.get("/snapshot/changes", response_model=SnapshotChangesOut)
def snapshot_changes(
    run_id: RunId,
    state: State,
    since: Annotated[
        str | None,
        Query(
            # the server never gives a longer position (it falls back to `xmin:xmin:`), and a
            # much longer query string is refused by the HTTP parser before the app sees it
            max_length=4096,
            pattern=r"^\d{1,20}:\d{1,20}:(\d{1,20}(,\d{1,20})*)?$",
            description="`position` of the previous read; left out: the whole snapshot",
        ),
    ] = None,
    who: Principal = Depends(allow_run(Role.COORDINATOR, Role.OBSERVER)),
) -> Response:
    """The snapshot as what changed since `since`, from one statement: cost follows the changes,
    not the samples in flight. Whole when `since` is left out or too old to answer from."""
    doc = state.protocol.snapshot_changes(run_id, since)
    # the statement's rows as they came: no model per row
    return respond_json(to_json(dict(zip(FIELDS, doc, strict=True))))


class _SnapshotJson(TypedDict):
    """ClusterSnapshotOut's fields in its order, the queued samples as QueuedView."""

    run_id: int
    version: int
    config: dict[str, Any]
    buffers: list[SnapshotBufferOut]
    instances: list[InstanceViewOut]
    queued: list[QueuedView]
    latest_params: int | None


_SNAPSHOT_EXCLUDE = {"queued": {"__all__": unpublished(QueuedView, QueuedSampleOut)}}


class _RouteJson(TypedDict):
    """RouteOut, the results as the data layer's RouteResult (less the route token)."""

    results: list[RouteResult]


_ROUTE_EXCLUDE = {"results": {"__all__": unpublished(RouteResult, RouteResultOut)}}


@router.post("/coordinator/lease", status_code=410, response_model=None, deprecated=True, responses=errors(410))
@router.post("/coordinator/release", status_code=410, response_model=None, deprecated=True, responses=errors(410))
@router.post("/coordinator/cycle", status_code=410, response_model=None, deprecated=True, responses=errors(410))
def coordinator_gone(run_id: RunId, who: Principal = Coordinator) -> JSONResponse:
    """Gone: the coordinator runs in-process against the database (`staleflow coordinator --run
    RUN`), which leads the run by its leader epoch and writes each cycle in one fenced transaction.
    Nothing is applied."""
    return JSONResponse(
        error_body(
            "gone",
            "the coordinator runs in-process against the database (`staleflow coordinator --run"
            f" {run_id}`): it takes the run's leader epoch and writes its cycles there, not over the API;"
            " nothing was applied",
        ),
        status_code=410,
    )


@router.post("/routes", response_model=RouteOut, responses=errors(409, 413))
def route(
    run_id: RunId, body: RouteIn, state: State, key: IdempotencyKey = None, who: Principal = Coordinator
) -> Response:
    """Route queued samples to instances in one transaction; a group's first routed member
    reserves a buffer entry. Each result says routed (with the attempt) or why not."""
    pairs = [(r.sample_id, r.instance_id) for r in body.routes]
    routed: set[int] = set()

    def call(conn: Connection) -> bytes:
        state.protocol.check_epoch(run_id, body.epoch, conn=conn)
        results = state.protocol.route(run_id, pairs, conn=conn)
        routed.clear()  # a deadlock retry reruns this
        routed.update(r.sample_id for r in results if r.outcome == RouteOutcome.ROUTED)
        return dump(_RouteJson, {"results": results}, _ROUTE_EXCLUDE)

    out, replayed = state.protocol.once_json(scoped_key(key, f"run{run_id}"), "route", body, call, RouteOut)
    if not replayed:
        targets = {instance_topic(i) for s, i in pairs if s in routed}
        if targets:
            state.notifier.publish(run_id, *targets)
    return respond_json(out)


@router.post("/commands/interrupt", response_model=CommandsOut, responses=errors(409, 413))
def interrupt(
    run_id: RunId,
    body: InterruptIn,
    state: State,
    key: IdempotencyKey = None,
    who: Principal = Coordinator,
) -> CommandsOut:
    """Ask the instances running these samples to interrupt them (they report what they have
    as an interrupted segment; the sample returns to the queue)."""

    def call(conn: Connection) -> CommandsOut:
        state.protocol.check_epoch(run_id, body.epoch, conn=conn)
        return CommandsOut(commands=state.protocol.interrupt(run_id, body.sample_ids, body.epoch, conn=conn))

    out, _ = state.protocol.once(scoped_key(key, f"run{run_id}"), "interrupt", body, call, CommandsOut)
    state.notifier.publish(run_id, WORK)
    return out


@router.post("/commands/pull", response_model=CommandsOut, responses=errors(409, 413))
def pull(
    run_id: RunId,
    body: PullIn,
    state: State,
    key: IdempotencyKey = None,
    who: Principal = Coordinator,
) -> CommandsOut:
    """Tell instances to load newer weights (`target_version`, default the run's version)."""

    def call(conn: Connection) -> CommandsOut:
        state.protocol.check_epoch(run_id, body.epoch, conn=conn)
        told = state.protocol.pull(run_id, body.instance_ids, body.target_version, body.epoch, conn=conn)
        return CommandsOut(commands=told)

    out, _ = state.protocol.once(scoped_key(key, f"run{run_id}"), "pull", body, call, CommandsOut)
    state.notifier.publish(run_id, *(instance_topic(i) for i in set(body.instance_ids)))
    return out


@router.post("/samples/abort", response_model=AbortedOut, responses=errors(409, 413))
def abort_samples(
    run_id: RunId,
    body: AbortSamplesIn,
    state: State,
    key: IdempotencyKey = None,
    who: Principal = Coordinator,
) -> AbortedOut:
    """Abort samples (stragglers, surplus); a group left with fewer than N live members is
    aborted too. Running samples get an abort command."""

    def call(conn: Connection) -> AbortedOut:
        state.protocol.check_epoch(run_id, body.epoch, conn=conn)
        return AbortedOut(aborted=state.protocol.abort_samples(run_id, body.sample_ids, body.reason, conn=conn))

    out, _ = state.protocol.once(scoped_key(key, f"run{run_id}"), "abort_samples", body, call, AbortedOut)
    state.notifier.publish(run_id, WORK, BATCH)
    return out


@router.post("/groups/{group_id}/abort", response_model=AbortGroupOut, responses=errors(409))
def abort_group(
    run_id: RunId,
    group_id: Annotated[int, Path(ge=1, le=2**63 - 1)],
    body: AbortGroupIn,
    state: State,
    key: IdempotencyKey = None,
    who: Principal = Coordinator,
) -> AbortGroupOut:
    """Abort a whole group and release its reservation."""

    def call(conn: Connection) -> AbortGroupOut:
        state.protocol.check_epoch(run_id, body.epoch, conn=conn)
        aborted = state.protocol.abort_group(run_id, group_id, body.reason, conn=conn)
        return AbortGroupOut(group_id=group_id, aborted=aborted)

    out, _ = state.protocol.once(scoped_key(key, f"run{run_id}"), f"abort_group{group_id}", body, call, AbortGroupOut)
    state.notifier.publish(run_id, WORK, BATCH)
    return out


@router.post("/abort-after-ready", response_model=DroppedGroupsOut)
def abort_after_ready(run_id: RunId, state: State, who: Principal = Coordinator) -> DroppedGroupsOut:
    """With redundancy: drop in-flight groups whose whole window is ready (they can never land)."""
    out = DroppedGroupsOut(groups=state.protocol.abort_after_ready(run_id))
    state.notifier.publish(run_id, WORK, BATCH)
    return out


@router.post("/instances/expire", response_model=ExpireOut)
def expire_instances(run_id: RunId, state: State, who: Principal = Coordinator) -> ExpireOut:
    """Fence instances whose instance lease ran out; their samples go back to the queue with their tokens."""
    return ExpireOut(expired=state.protocol.expire_instances(run_id))
