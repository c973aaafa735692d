"""Runs, their status and parameter versions, prompts, and API tokens."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Path
from sqlalchemy import Connection

from staleflow_db.protocol import Prompt
from staleflow_db.types import RunConfig
from workers.wire.enums import Role, RunState
from workers.wire.models import (
    EnqueueIn,
    EnqueueOut,
    ParamVersionList,
    Revoked,
    RunCreate,
    RunList,
    RunOut,
    RunStateIn,
    RunStateOut,
    RunStatus,
    TokenCreate,
    TokenCreated,
    TokenList,
    errors,
)

from .. import auth
from ..auth import Principal
from ..body import ModelBodyRoute
from ..deps import IdempotencyKey, Offset, Page, RunId, State, allow, allow_run, principal, run_filter
from ..service import from_data, scoped_key

router = APIRouter(route_class=ModelBodyRoute, prefix="/v1", responses=errors(401, 403, 422, 503))
RUN_ROLES = tuple(Role)


@router.post("/runs", status_code=201, response_model=RunOut, responses=errors(409), tags=["runs"])
def create_run(
    body: RunCreate,
    state: State,
    key: IdempotencyKey = None,
    who: Principal = Depends(allow(global_only=True)),
) -> RunOut:
    """Create a run with its protocol configuration (admin). Names are unique."""
    cfg = RunConfig(**body.config.model_dump())

    def call(conn: Connection) -> RunOut:
        run_id = state.protocol.create_run(body.name, cfg, conn=conn)
        return from_data(RunOut, state.protocol.reads.get_run(run_id, conn=conn))

    out, _ = state.protocol.once(scoped_key(key, "runs"), "create_run", body, call, RunOut)
    return out


@router.get("/runs", response_model=RunList, tags=["runs"])
def list_runs(
    state: State,
    who: Annotated[Principal, Depends(principal)],
    limit: Page = 100,
    offset: Offset = 0,
) -> RunList:
    """Runs by id; a run-scoped token sees only its own."""
    runs = state.protocol.reads.list_runs(run_filter(who, None), limit, offset)
    return from_data(RunList, {"runs": runs})


@router.get("/runs/{run_id}", response_model=RunStatus, responses=errors(404), tags=["runs"])
def run_status(run_id: RunId, state: State, who: Principal = Depends(allow_run(*RUN_ROLES))) -> RunStatus:
    """Version, buffers with their states, sample and group counts, queue by version."""
    return RunStatus.model_validate(state.protocol.reads.status(run_id))


def _set_state(state: State, run_id: int, to: RunState, body: RunStateIn | None) -> RunStateOut:
    aborted = state.protocol.set_state(run_id, to, body.reason if body else None)
    run = from_data(RunOut, state.protocol.reads.get_run(run_id))
    return RunStateOut(run=run, aborted_groups=len(aborted))


@router.post("/runs/{run_id}/pause", response_model=RunStateOut, responses=errors(404, 409), tags=["runs"])
def pause_run(
    run_id: RunId, state: State, body: RunStateIn | None = None, who: Principal = Depends(allow_run())
) -> RunStateOut:
    """Pause (admin): nothing new is routed, so instances get no new work; in-flight samples
    finish, are scored and train. Enqueue, consume and publish go on. Pausing again is a no-op;
    a cancelled run answers 409."""
    return _set_state(state, run_id, RunState.PAUSED, body)


@router.post("/runs/{run_id}/resume", response_model=RunStateOut, responses=errors(404, 409), tags=["runs"])
def resume_run(
    run_id: RunId, state: State, body: RunStateIn | None = None, who: Principal = Depends(allow_run())
) -> RunStateOut:
    """Resume a paused run (admin); resuming an active run is a no-op, a cancelled one 409."""
    return _set_state(state, run_id, RunState.ACTIVE, body)


@router.post("/runs/{run_id}/cancel", response_model=RunStateOut, responses=errors(404, 409), tags=["runs"])
def cancel_run(
    run_id: RunId, state: State, body: RunStateIn | None = None, who: Principal = Depends(allow_run())
) -> RunStateOut:
    """Cancel (admin), for good: every unfinished group and its live samples end aborted with the
    reason `run_cancelled` (running ones get an abort command); finished groups waiting in a
    buffer stay, never trained. From then on enqueue, routing, registering, consume and publish
    answer 409 (code `run_not_active`). Cancelling again is a no-op."""
    return _set_state(state, run_id, RunState.CANCELLED, body)


@router.get("/runs/{run_id}/versions", response_model=ParamVersionList, responses=errors(404), tags=["runs"])
def param_versions(
    run_id: RunId,
    state: State,
    limit: Page = 10,
    who: Principal = Depends(allow_run(*RUN_ROLES)),
) -> ParamVersionList:
    """Published parameter versions, newest first (size, checksum, where to pull them)."""
    return from_data(ParamVersionList, {"versions": state.protocol.reads.param_versions(run_id, limit)})


@router.post(
    "/runs/{run_id}/prompts",
    response_model=EnqueueOut,
    responses=errors(404, 413),
    tags=["runs"],
)
def enqueue(
    run_id: RunId,
    body: EnqueueIn,
    state: State,
    who: Principal = Depends(allow_run(Role.TRAINER, Role.COORDINATOR)),
) -> EnqueueOut:
    """Enqueue prompt groups. Idempotent by `client_key`: a key seen before returns its group."""
    prompts = [Prompt(p.client_key, p.prompt_tokens, p.meta) for p in body.prompts]
    return EnqueueOut(group_ids=state.protocol.enqueue(run_id, prompts))


@router.post("/tokens", status_code=201, response_model=TokenCreated, responses=errors(404), tags=["tokens"])
def create_token(body: TokenCreate, state: State, who: Principal = Depends(allow())) -> TokenCreated:
    """Create a token (admin). A run-scoped admin creates tokens for its own run only."""
    run_id = run_filter(who, body.run_id) if who.run_id is not None else body.run_id
    return TokenCreated.model_validate(auth.create_token(state.engine, body.role, run_id, body.name))


@router.get("/tokens", response_model=TokenList, tags=["tokens"])
def list_tokens(state: State, who: Principal = Depends(allow())) -> TokenList:
    """Tokens without their secrets (admin)."""
    return TokenList.model_validate({"tokens": auth.list_tokens(state.engine, who.run_id)})


@router.delete("/tokens/{token_id}", response_model=Revoked, responses=errors(404), tags=["tokens"])
def revoke_token(
    token_id: Annotated[int, Path(ge=1, le=2**63 - 1)],
    state: State,
    who: Principal = Depends(allow()),
) -> Revoked:
    """Revoke a token (admin). Replicas stop accepting it within the token cache time."""
    try:
        revoked = auth.revoke_token(state.engine, token_id, who.run_id)
    except auth.OtherRun as exc:
        raise HTTPException(403, str(exc)) from None
    state.tokens.forget()
    return Revoked(id=token_id, revoked=revoked)
