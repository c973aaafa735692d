"""Node sync: one process hosting several rollout instances (a GPU node) sends their reports,
lease renewals and snapshots in ONE call and one transaction, and long-polls for the work and
commands of all of them at once (staleflow_db.protocol.node). Every instance keeps its own
lease and fences: the outcome is per instance."""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import Response
from sqlalchemy import Connection
from starlette.concurrency import run_in_threadpool
from typing_extensions import TypedDict

from staleflow_db.errors import NotFound
from staleflow_db.protocol import NodeDelivery, NodeHeartbeat, NodeItem, NodeOutcome
from staleflow_db.protocol.rollout import Command, Work
from workers.wire.enums import Role, SegmentKind
from workers.wire.models import NodeErrorOut, NodeItemOut, NodeSyncIn, NodeSyncOut, errors
from workers.wire.models.common import Limit

from ..auth import Principal
from ..body import ModelBodyRoute
from ..deps import AppState, IdempotencyKey, RunId, State, Wait, allow_run, long_poll
from ..notify import REWARDS, instance_topic
from ..service import dump, respond, respond_json, scoped_key
from .rollout import reports_of

router = APIRouter(
    route_class=ModelBodyRoute, prefix="/v1/runs/{run_id}", tags=["rollout"], responses=errors(401, 403, 404, 422, 503)
)
Rollout = Depends(allow_run(Role.ROLLOUT))


@router.post("/instances/sync", response_model=NodeSyncOut, responses=errors(409, 413))
async def sync(
    request: Request,
    run_id: RunId,
    body: NodeSyncIn,
    state: State,
    key: IdempotencyKey = None,
    wait: Wait = 0.0,
    limit: Limit = 1000,
    who: Principal = Rollout,
) -> Response:
    """The calls of several instances of one process in one: `items` (per instance, its report
    as POST .../segments takes it, and/or a heartbeat) applied in one transaction, then `poll`
    (instances to deliver work and commands for, as POST .../poll; a long-poll with `wait`,
    returning when any of them has something). Each item and each delivery has its own outcome:
    409 when its instance's lease lapsed or a route it quotes is lost (that item is not applied,
    the others are; a fenced instance registers again). Bad input refuses the whole call, naming
    the item: nothing applied. Send an Idempotency-Key: a retry gets the same outcomes back (the
    same key with another body: 409 idempotency_key_reused)."""
    _check(body)
    ids = [(f"items.{k}.instance_id", it.instance_id) for k, it in enumerate(body.items)]
    ids += [(f"poll.{k}", iid) for k, iid in enumerate(body.poll)]
    if all(iid in state.instance_owners for _, iid in ids):  # cached: no I/O, no thread hand-off
        _owned(state, run_id, ids, who)
    else:
        await run_in_threadpool(_owned, state, run_id, ids, who)
    skey = scoped_key(key, f"run{run_id}:tok{who.token_id}:node")
    results: list[NodeItemOut] = []
    if body.items:
        results = await run_in_threadpool(_apply, state, run_id, body, scoped_key(skey, "items"))
    if not body.poll:
        return respond(NodeSyncOut(results=results))
    pkey = scoped_key(skey, "poll")

    def call(conn: Connection) -> bytes:
        return _polled(state.protocol.poll_node(body.poll, limit, conn=conn))

    def idle(conn: Connection) -> bytes | None:
        # a re-check with nothing to deliver to any instance: one read in autocommit, no transaction
        if not state.protocol.poll_node_idle(body.poll, pkey, conn=conn):
            return None
        return _polled([NodeDelivery(i) for i in body.poll])

    def fetch(check_idle: bool = True) -> bytes:
        return state.protocol.once_json(
            pkey, "node_poll", body, call, NodeSyncOut, store=_delivered, idle=idle if check_idle else None
        )[0]

    topics = [instance_topic(i) for i in body.poll]
    # an instance's topic wakes for its routes and commands only: after a wake, the transaction
    polled = await long_poll(request, state, run_id, topics, wait, fetch, _answered, lambda: fetch(False))
    if not results:
        return respond_json(polled)
    return respond(NodeSyncOut(results=results, deliveries=NodeSyncOut.model_validate_json(polled).deliveries))


def _check(body: NodeSyncIn) -> None:
    """What the models cannot say: each instance once per part, and an item that does something."""
    seen: set[int] = set()
    for k, it in enumerate(body.items):
        where = f"items.{k}"
        if it.instance_id in seen:
            raise HTTPException(422, f"{where}.instance_id: instance {it.instance_id} has an item already")
        seen.add(it.instance_id)
        if not it.reports and it.heartbeat is None:
            raise HTTPException(422, f"{where}: neither reports nor a heartbeat")
        if it.snapshot is not None and not it.reports:
            raise HTTPException(422, f"{where}.snapshot: rides with reports only (a heartbeat carries its own)")
    if len(set(body.poll)) != len(body.poll):
        raise HTTPException(422, "poll: an instance appears twice")


def _owned(state: AppState, run_id: int, ids: list[tuple[str, int]], who: Principal) -> None:
    for where, iid in ids:
        try:
            state.instance_in_run(run_id, iid, who)
        except NotFound as e:
            raise NotFound(f"{where}: {e}") from None
        except HTTPException as e:
            raise HTTPException(e.status_code, f"{where}: {e.detail}") from None


def _apply(state: AppState, run_id: int, body: NodeSyncIn, key: str | None) -> list[NodeItemOut]:
    items = [
        NodeItem(
            it.instance_id,
            reports_of(it.reports, it.instance_id),
            it.snapshot.model_dump() if it.snapshot is not None else None,
            None
            if it.heartbeat is None
            else NodeHeartbeat(it.heartbeat.version, it.heartbeat.snapshot.model_dump(), it.heartbeat.lease_seconds),
        )
        for it in body.items
    ]

    def call(conn: Connection) -> NodeSyncOut:
        return NodeSyncOut(results=[_result(o) for o in state.protocol.sync_node(run_id, items, conn=conn)])

    out, replayed = state.protocol.once(key, "node_sync", body, call, NodeSyncOut)
    finished = any(
        r.status == 200 and any(s.kind == SegmentKind.FINISHED for s in it.reports)
        for r, it in zip(out.results, body.items, strict=True)
    )
    if finished and not replayed:
        state.notifier.publish(run_id, REWARDS)
    return out.results


def _error(code: str | None, message: str | None, refused: list[tuple[int, str]]) -> NodeErrorOut:
    return NodeErrorOut(
        code=code or "conflict", message=message or "", items=[{"id": i, "reason": why} for i, why in refused[:100]]
    )


def _result(o: NodeOutcome) -> NodeItemOut:
    if o.refused is None:
        return NodeItemOut(instance_id=o.instance_id, status=200, applied=o.applied)
    return NodeItemOut(instance_id=o.instance_id, status=409, applied=0, error=_error(o.code, o.message, o.refused))


class _DeliveryJson(TypedDict):
    """NodeDeliveryOut, its work and commands as the data layer's Work and Command (their fields
    are the model's)."""

    instance_id: int
    status: int
    work: list[Work]
    commands: list[Command]
    error: NodeErrorOut | None


class _PolledJson(TypedDict):
    """NodeSyncOut of a poll: no item results."""

    results: list[NodeItemOut]
    deliveries: list[_DeliveryJson]


def _polled(delivered: list[NodeDelivery]) -> bytes:
    """The poll's NodeSyncOut as JSON, serialised from the data layer's deliveries without a
    model per work item (each carries its prompt: a validated list per work item cost more
    than the poll's statements)."""
    deliveries: list[_DeliveryJson] = [
        {"instance_id": d.instance_id, "status": 200, "work": d.poll.work, "commands": d.poll.commands, "error": None}
        if d.refused is None
        else {
            "instance_id": d.instance_id,
            "status": 409,
            "work": [],
            "commands": [],
            "error": _error(d.code, d.message, d.refused),
        }
        for d in delivered
    ]
    return dump(_PolledJson, {"results": [], "deliveries": deliveries})


# A poll's JSON is compact, its keys in the models' order: a delivery with work or commands holds
# `"work":[{` or `"commands":[{`, a fenced one `"status":409`. Nothing else can: a string's quotes
# are escaped, and the only free JSON, a prompt's `meta`, lies inside a work item.
_WORK, _COMMANDS, _FENCED = b'"work":[{', b'"commands":[{', b'"status":409'


def _delivered(out: bytes) -> bool:
    """Kept under the key: a delivery (delivered once; a retry must get it back)."""
    return _WORK in out or _COMMANDS in out


def _answered(out: bytes) -> bool:
    """The long-poll returns: something delivered, or an instance fenced (it registers again)."""
    return _delivered(out) or _FENCED in out
