"""Runs, prompts, parameter versions and tokens."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from ..enums import Role
from .common import INT32_MAX, Bool, Count, Id, In, Int, Key, Location, Meta, Name, Out, TokenId, Version


class RunConfigIn(In):
    batch_size: Int = Field(ge=1, le=1_000_000, description="B: groups per training batch")
    group_size: Int = Field(ge=1, le=65_535, description="N: responses per prompt group")
    eta: Int = Field(ge=0, le=1_000_000, description="staleness bound")
    buffer_capacity: Int | None = Field(None, ge=1, le=1_000_000, description="B' >= B (batch-level redundancy)")
    samples_per_group: Int | None = Field(None, ge=1, le=32_767, description="N' >= N (group-level redundancy)")
    max_response_tokens: Int = Field(1024, ge=1, le=INT32_MAX)
    max_prompt_tokens: Int = Field(1024, ge=1, le=INT32_MAX)
    dapo_filter: Bool = False


class RunCreate(In):
    name: Name
    config: RunConfigIn


class RunConfigOut(Out):
    batch_size: int
    buffer_capacity: int
    group_size: int
    samples_per_group: int
    eta: int
    max_response_tokens: int
    max_prompt_tokens: int
    dapo_filter: bool


class RunOut(Out):
    id: int
    name: str
    version: int
    config: RunConfigOut
    created_at: datetime


class RunList(Out):
    runs: list[RunOut]


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


class ParamVersionList(Out):
    versions: list[ParamVersionOut]


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
    "RunStatus",
    "TokenCreate",
    "TokenCreated",
    "TokenList",
    "TokenOut",
    "Version",
    "Location",
]
