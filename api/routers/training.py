"""Reward workers (claim finished samples, post rewards) and the trainer (long-poll for the ready
batch at its version, publish the next version)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from sqlalchemy import Connection
from typing_extensions import TypedDict

from staleflow_db import group_commit
from staleflow_db.protocol.scoring import RewardTask
from staleflow_db.protocol.training import Batch
from workers.wire.enums import Role
from workers.wire.models import (
    ClaimIn,
    ClaimOut,
    ConsumeOut,
    DropsOut,
    PublishIn,
    PublishOut,
    RewardDropsIn,
    RewardsIn,
    RewardsOut,
    errors,
)
from workers.wire.packed import PACKED_CONTEXT

from ..auth import Principal
from ..body import ModelBodyRoute
from ..deps import IdempotencyKey, RunId, State, Wait, allow_run, long_poll
from ..notify import BATCH, REWARDS, WORK
from ..packed_batch import consumed_json
from ..service import dump, from_data, respond, respond_json, scoped_key

router = APIRouter(route_class=ModelBodyRoute, prefix="/v1/runs/{run_id}", responses=errors(401, 403, 404, 422, 503))
Reward = Depends(allow_run(Role.REWARD))
Trainer = Depends(allow_run(Role.TRAINER))
VersionPath = Annotated[int, Path(ge=0, le=2**31 - 1, description="the buffer: model version it trains")]


@router.post("/rewards/claim", response_model=ClaimOut, tags=["reward"])
async def claim(
    request: Request,
    run_id: RunId,
    body: ClaimIn,
    state: State,
    key: IdempotencyKey = None,
    wait: Wait = 0.0,
    packed: Annotated[bool, Query(description="token ids as packed arrays (base64 strings)")] = False,
    who: Principal = Reward,
) -> Response:
    """Long-poll: claim up to `limit` finished samples for scoring. Claims not scored within
    `claim_seconds` become claimable again; with an Idempotency-Key a retry gets the same claim.
    `packed`: `prompt_tokens` and `response_tokens` as base64 of little-endian int32."""
    skey = scoped_key(key, f"run{run_id}")
    context = PACKED_CONTEXT if packed else None

    def call(conn: Connection) -> bytes:
        tasks = state.protocol.claim_rewards(run_id, body.limit, body.claim_seconds, conn=conn)
        return dump(_ClaimJson, {"tasks": tasks}, context=context)

    def idle(conn: Connection) -> bytes | None:
        # a re-check with nothing to claim: one read in autocommit, no transaction
        return _NO_TASKS if state.protocol.claim_idle(run_id, skey, conn=conn) else None

    def fetch() -> bytes:
        return state.protocol.once_json(
            skey, "claim", body, call, ClaimOut, store=_claimed, idle=idle, context=context
        )[0]

    return respond_json(await long_poll(request, state, run_id, REWARDS, wait, fetch, _claimed))


class _ClaimJson(TypedDict):
    """ClaimOut, the tasks as the data layer's RewardTask (its fields are the model's)."""

    tasks: list[RewardTask]


_NO_TASKS = dump(_ClaimJson, {"tasks": []})


def _claimed(out: bytes) -> bool:
    return out != _NO_TASKS


@router.post("/rewards", response_model=RewardsOut, responses=errors(409, 413), tags=["reward"])
def record_rewards(
    run_id: RunId,
    body: RewardsIn,
    state: State,
    key: IdempotencyKey = None,
    who: Principal = Reward,
) -> Response:
    """Post rewards, each fenced by its claim's `reward_attempt`. Groups that reach N rewarded
    members are placed in a buffer (or filtered, or dropped) in the same transaction."""
    rewards = [(r.sample_id, r.reward_attempt, r.reward, r.metrics) for r in body.rewards]

    def call(conn: Connection) -> RewardsOut:
        groups = state.protocol.record_rewards(run_id, rewards, scorer=who.token_id, conn=conn)
        return from_data(RewardsOut, {"groups": groups})

    skey = scoped_key(key, f"run{run_id}")
    out, replayed = state.writes.once(skey, "reward", body, call, RewardsOut, group_commit.run_lock(run_id))
    if not replayed and out.groups:
        # Occupied groups may make a buffer ready; surplus members get abort commands.
        state.notifier.publish(run_id, BATCH, WORK)
    return respond(out)


@router.post("/rewards/drop", response_model=DropsOut, responses=errors(409, 413), tags=["reward"])
def drop_rewards(
    run_id: RunId,
    body: RewardDropsIn,
    state: State,
    key: IdempotencyKey = None,
    who: Principal = Reward,
) -> Response:
    """Give up on claimed samples (the reward failed): each is aborted with `reason` (default
    `reward_failed`), fenced by its claim's `reward_attempt` like a reward (409 when a claim
    was lost; all or nothing). A group left with fewer than N live members is aborted too. A
    drop already done at that attempt is skipped, so a retry changes nothing."""
    drops = [(d.sample_id, d.reward_attempt) for d in body.drops]

    def call(conn: Connection) -> DropsOut:
        return DropsOut(dropped=state.protocol.drop_rewards(run_id, drops, body.reason, conn=conn))

    out, replayed = state.protocol.once(scoped_key(key, f"run{run_id}"), "reward_drop", body, call, DropsOut)
    if not replayed and out.dropped:
        # a dropped group frees its reservation: rollout work and, through a cascade, batches
        state.notifier.publish(run_id, BATCH, WORK)
    return respond(out)


@router.post(
    "/batches/{version}/consume",
    response_model=ConsumeOut,
    responses=errors(409),
    tags=["trainer"],
)
async def consume(
    request: Request,
    run_id: RunId,
    version: VersionPath,
    state: State,
    wait: Wait = 0.0,
    packed: Annotated[bool, Query(description="token ids and log-probs as packed arrays (base64 strings)")] = False,
    who: Principal = Trainer,
) -> Response:
    """Long-poll until buffer `version` is ready, then take a new consume fence on it and return the
    whole batch. 409 when the run is not at `version`. A repeated consume takes a new fence
    (fencing the earlier one), so a retry after a lost response is safe without a request id.
    `packed`: `prompt_tokens`, `tokens` and `logprobs` as base64 of little-endian int32 / float32."""

    def fetch() -> bytes | None:
        # The batch (every token and log-prob of B x N samples) serialised from the dataclasses.
        batch = state.protocol.consume(run_id, version)
        if batch is None:
            return None
        if packed:
            return consumed_json(version, batch)
        return dump(_ConsumeJson, {"ready": True, "version": version, "batch": batch})

    out = await long_poll(request, state, run_id, BATCH, wait, fetch, lambda o: o is not None)
    return respond_json(out or dump(_ConsumeJson, {"ready": False, "version": version, "batch": None}))


class _ConsumeJson(TypedDict):
    """ConsumeOut, the batch as the data layer's Batch (its fields, nested, are the models')."""

    ready: bool
    version: int
    batch: Batch | None


@router.post(
    "/batches/{version}/publish",
    response_model=PublishOut,
    responses=errors(409),
    tags=["trainer"],
)
def publish(
    run_id: RunId,
    version: VersionPath,
    body: PublishIn,
    state: State,
    who: Principal = Trainer,
) -> Response:
    """Buffer `version` is trained: mark it consumed and make `version + 1` the run's version,
    with the new parameters' size, checksum and location. Only with the latest consume fence
    and in version order (409 otherwise); publishing the same version again is a no-op."""
    new = state.protocol.publish(
        run_id, version, body.consume_fence, body.size_bytes, body.checksum, body.location, body.metrics
    )
    state.notifier.publish(run_id, BATCH, WORK)
    return respond(PublishOut(version=new))
