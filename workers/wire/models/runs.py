"""Runs, prompts, parameter versions and tokens."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, Field, Strict, create_model

from .. import run_config
from ..enums import Role, RunState
from .common import Count, Id, In, Key, Location, Meta, Name, Out, TokenId, Version


def _run_config_model(base: type[BaseModel], name: str, *, request: bool) -> Any:
    """A model of `RunConfig`'s fields: for requests with their bounds and defaults (strict
    types; a field that defaults to another is optional, None), for responses every field."""
    fields: dict[str, Any] = {}
    for f in run_config.CONFIG_FIELDS:
        spec, tp = run_config.SPECS[f], run_config.FIELD_TYPES[f]
        if not request:
            fields[f] = (tp, Field(description=spec.description))
            continue
        strict: Any = Annotated[tp, Strict()]
        if spec.defaults_to is not None:  # optional: None takes the other field's value
            fields[f] = (strict | None, Field(None, ge=spec.ge, le=spec.le, description=spec.description))
        else:
            value = ... if f in run_config.REQUIRED else run_config.default(f)
            fields[f] = (strict, Field(value, ge=spec.ge, le=spec.le, description=spec.description))
    return create_model(name, __base__=base, __module__=__name__, **fields)


if TYPE_CHECKING:  # generated below: a type checker sees their bases
    RunConfigIn = In
    RunConfigOut = Out
else:
    RunConfigIn = _run_config_model(In, "RunConfigIn", request=True)
    RunConfigOut = _run_config_model(Out, "RunConfigOut", request=False)


class RunCreate(In):
    name: Name
    config: RunConfigIn


class RunOut(Out):
    id: int
    name: str
    version: int
    config: RunConfigOut
    created_at: datetime
    state: RunState
    state_reason: str | None = Field(description="why it was paused or cancelled")


class RunList(Out):
    runs: list[RunOut]


class RunStateIn(In):
    reason: str | None = Field(None, min_length=1, max_length=1000, description="why (kept with the run)")


class RunStateOut(Out):
    run: RunOut
    aborted_groups: int = Field(0, description="groups a cancel aborted (reason `run_cancelled`)")


class BufferOut(Out):
    index: int
    occupied: int
    reserved: int
    state: str = Field(description="waiting, stuck, ready or consumed")


class QueuedByVersion(Out):
    v_traj: int | None = Field(description="None: never routed")
    count: int


class RunStatus(Out):
    run_id: int
    name: str
    state: RunState
    state_reason: str | None = Field(description="why it was paused or cancelled")
    version: int
    config: RunConfigOut
    buffers: list[BufferOut]
    samples: dict[str, int]
    groups: dict[str, int]
    queued_by_version: list[QueuedByVersion]
    active_instances: int


class ParamVersionOut(Out):
    version: int
    size_bytes: int | None
    checksum: str | None
    location: str | None
    created_at: datetime
    train_metrics: dict[str, float] | None = Field(None, description="what the trainer reported of the step")


class ParamVersionList(Out):
    versions: list[ParamVersionOut]


class ParamSecretOut(Out):
    run_id: int
    keys: dict[str, str] = Field(
        description="the run's parameter-server keys (hex) by role: rollout for a rollout token; "
        "trainer and rollout for a trainer or admin token (docs/security.md)"
    )


class PromptIn(In):
    client_key: Key = Field(
        description="the caller's key: enqueueing the same key again returns the same group;"
        " keys starting with `~` are reserved (re-enqueued filtered groups)"
    )
    prompt_tokens: list[TokenId] = Field(min_length=1)
    meta: Meta = Field(default_factory=dict)


class EnqueueIn(In):
    prompts: list[PromptIn] = Field(min_length=1)


class EnqueueOut(Out):
    group_ids: list[int] = Field(description="one per prompt, in order")


class TokenCreate(In):
    role: Role
    run_id: Id | None = Field(None, description="None: valid for every run")
    name: Name | None = None


class TokenOut(Out):
    id: int
    role: Role
    run_id: int | None
    name: str | None
    created_at: datetime
    revoked_at: datetime | None


class TokenCreated(TokenOut):
    token: str = Field(description="shown once; only its hash is stored")


class TokenList(Out):
    tokens: list[TokenOut]


class Revoked(Out):
    id: int
    revoked: bool


__all__ = [
    "BufferOut",
    "Count",
    "EnqueueIn",
    "EnqueueOut",
    "ParamSecretOut",
    "ParamVersionList",
    "ParamVersionOut",
    "PromptIn",
    "QueuedByVersion",
    "Revoked",
    "RunConfigIn",
    "RunConfigOut",
    "RunCreate",
    "RunList",
    "RunOut",
    "RunStateIn",
    "RunStateOut",
    "RunStatus",
    "TokenCreate",
    "TokenCreated",
    "TokenList",
    "TokenOut",
    "Version",
    "Location",
]
