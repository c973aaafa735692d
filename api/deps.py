"""Dependencies of the routers: the app's state, authentication and run scope, request ids,
and the long-poll loop."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, TypeVar

from fastapi import Depends, Header, HTTPException, Path, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import Engine
from starlette.concurrency import run_in_threadpool

from staleflow_db.errors import NotFound
from staleflow_db.protocol import InstanceOwner
from workers.wire.enums import Role
from workers.wire.types import is_run_id

from .auth import Principal, TokenCache
from .group_commit import GroupCommit
from .metrics import Metrics
from .notify import Notifier, wait_any
from .service import ApiProtocol
from .settings import ApiSettings

T = TypeVar("T")


@dataclass
class AppState:
    settings: ApiSettings
    engine: Engine
    protocol: ApiProtocol
    notifier: Notifier
    tokens: TokenCache
    metrics: Metrics
    # the writes that may share a transaction with other calls' (api/group_commit.py)
    writes: GroupCommit
    url: str | None = None
    schema_head: str | None = None
    # instance -> (run, registering token) never changes once registered, so it is cached
    # without expiry. (A deleted token's instances keep their cached owner: nobody can
    # present a deleted token anyway.)
    instance_owners: dict[int, InstanceOwner] = field(default_factory=dict)
    # run name -> id: names are unique and never change, and runs are never deleted
    run_names: dict[str, int] = field(default_factory=dict)

    def instance_in_run(self, run_id: int, instance_id: int, who: Principal) -> None:
        """404 unless the instance is in the run; 403 unless `who` registered it or is an
        admin (an instance registered in-process, without a token, is an admin's alone)."""
        owner = self.instance_owners.get(instance_id)
        if owner is None:
            owner = self.protocol.reads.instance_owner(instance_id)
            if owner is not None:
                if len(self.instance_owners) > 100_000:
                    self.instance_owners.clear()
                self.instance_owners[instance_id] = owner
        if owner is None or owner.run_id != run_id:
            raise NotFound(f"instance {instance_id} in run {run_id}")
        if who.role != Role.ADMIN and owner.token_id != who.token_id:
            raise HTTPException(403, f"instance {instance_id} belongs to another token")


# Dependencies are `async def` where they do no I/O: FastAPI runs a plain `def` dependency in
# the thread pool, one hand-off (and GIL round trip) each, three or four per request before.
# The ones every request runs (the run, the token) take the Request, not other dependencies:
# FastAPI solves a dependency's whole sub-tree again wherever it is named, cached or not, and
# State and the bearer credentials under both the run and the principal would be ~11 solves
# per call, each some microseconds (docs/benchmarks.md, "The fixed cost of a call").
async def get_state(request: Request) -> AppState:
    return _state(request)


def _state(request: Request) -> AppState:
    state: AppState = request.app.state.staleflow
    return state


State = Annotated[AppState, Depends(get_state)]

_bearer = HTTPBearer(auto_error=False, description="a token from `staleflow token create`")


async def resolve_run(
    request: Request, run_id: Annotated[str, Path(min_length=1, max_length=200, description="run id or name")]
) -> int:
    """`{run_id}` in a path: the run's id, or its name (names are never all digits, so digits
    are an id), resolved once per request (FastAPI caches a dependency within a request). A
    name no run has is 404 -- after the token's checks, so that a run-scoped token learns
    nothing about other runs (403, as for an id)."""
    if is_run_id(run_id):
        if not 1 <= int(run_id) <= 2**63 - 1:
            raise HTTPException(422, f"run id {run_id} out of range 1..{2**63 - 1}")
        return int(run_id)
    state = _state(request)
    found = state.run_names.get(run_id)
    if found is None:  # the lookup blocks: in the thread pool
        try:
            found = await run_in_threadpool(state.protocol.reads.run_id, run_id)
        except NotFound:
            creds = await _bearer(request)
            if creds is not None:
                who = await principal(request, creds)  # 401 for a bad token
                if who.run_id is not None:
                    raise HTTPException(403, f"this token is limited to run {who.run_id}") from None
            raise
        if len(state.run_names) > 100_000:
            state.run_names.clear()
        state.run_names[run_id] = found
    return found


RunId = Annotated[int, Depends(resolve_run)]
InstanceId = Annotated[int, Path(ge=1, le=2**63 - 1, description="instance id")]
IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=200,
        pattern=r"^[\x21-\x7e]+$",
        description="request id, 1-200 visible ASCII characters (no spaces): a retry with the same key"
        " returns the stored outcome",
    ),
]
Wait = Annotated[
    float, Query(ge=0, le=3600, allow_inf_nan=False, description="long-poll: seconds to wait (capped by the server)")
]
Page = Annotated[int, Query(ge=1, le=10_000)]
Offset = Annotated[int, Query(ge=0, le=2**31 - 1)]


async def principal(
    request: Request, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Principal:
    state = _state(request)
    if creds is None or not creds.credentials:
        raise HTTPException(401, "missing bearer token (Authorization: Bearer <token>)", {"WWW-Authenticate": "Bearer"})
    if len(creds.credentials) > 200:
        raise HTTPException(401, "invalid token", {"WWW-Authenticate": "Bearer"})
    hit, found = state.tokens.cached(creds.credentials)
    if not hit:  # the database lookup blocks: in the thread pool
        found = await run_in_threadpool(state.tokens.lookup, creds.credentials)
    if found is None:
        raise HTTPException(401, "invalid or revoked token", {"WWW-Authenticate": "Bearer"})
    return found


def _check_role(who: Principal, roles: tuple[Role, ...]) -> None:
    if who.role != Role.ADMIN and who.role not in roles:
        allowed = ", ".join(r.value for r in (Role.ADMIN, *roles))
        raise HTTPException(403, f"role {who.role.value} may not do this (needs {allowed})")


def allow(*roles: Role, global_only: bool = False) -> Callable[..., Awaitable[Principal]]:
    """Any run (or none): the role must match; `global_only` also refuses run-scoped tokens."""

    async def dep(who: Annotated[Principal, Depends(principal)]) -> Principal:
        _check_role(who, roles)
        if global_only and who.run_id is not None:
            raise HTTPException(403, f"this token is limited to run {who.run_id}")
        return who

    return dep


def allow_run(*roles: Role) -> Callable[..., Awaitable[Principal]]:
    """Endpoints under /v1/runs/{run_id}: the role must match and the token must cover the run."""

    async def dep(run_id: RunId, who: Annotated[Principal, Depends(principal)]) -> Principal:
        _check_role(who, roles)
        if not who.may_use_run(run_id):
            raise HTTPException(403, f"this token is limited to run {who.run_id}")
        return who

    return dep


def run_filter(who: Principal, run_id: int | None) -> int | None:
    """For reads across runs: a run-scoped token sees only its run."""
    if who.run_id is None:
        return run_id
    if run_id is not None and run_id != who.run_id:
        raise HTTPException(403, f"this token is limited to run {who.run_id}")
    return who.run_id


async def long_poll(
    request: Request,
    state: AppState,
    run_id: int,
    topic: str | Sequence[str],
    wait: float,
    fetch: Callable[[], T],
    done: Callable[[T], bool],
    fetch_woken: Callable[[], T] | None = None,
) -> T:
    """Call `fetch` (a short transaction, in a thread) until `done` or the wait ends. Between
    calls no transaction is open: the wait is on an in-process event (woken on commit here
    or by NOTIFY from another replica) with a polling fallback. Several topics: woken by any.
    `fetch_woken`: the call after a wake instead of `fetch` (where a topic's wake says there is
    something to deliver, it skips the idle read `fetch` starts with)."""
    deadline = time.monotonic() + min(wait, state.settings.max_wait)
    notifier = state.notifier
    topics = [topic] if isinstance(topic, str) else list(topic)
    woken = False
    while True:
        events = [notifier.event(run_id, t) for t in topics]
        result = await run_in_threadpool(fetch_woken if woken and fetch_woken is not None else fetch)
        remaining = deadline - time.monotonic()
        if done(result) or remaining <= 0 or notifier.draining or await request.is_disconnected():
            return result
        with state.metrics.waiting(topics[0]):
            recheck = state.settings.notified_poll_interval if notifier.listening else state.settings.poll_interval
            woken = await wait_any(events, min(remaining, recheck))
