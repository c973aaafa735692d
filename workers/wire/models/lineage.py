"""Lineage of a trained step and the export of a run's rollouts (GET /v1/runs/{run}/lineage,
/v1/runs/{run}/export)."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from .common import Out

__all__ = ["ExportPage", "ExportRow", "LineageOut", "LineageRow"]


class LineageRow(Out):
    """One segment of a trained sample (`trained_lineage`)."""

    step: int
    sample_id: int
    group_id: int
    idx: int
    v_traj: int
    staleness: int
    seq: int
    generated: bool = Field(description="false: an environment observation (loss mask 0, no version)")
    version: int | None = Field(description="the model version that generated it")
    instance_id: int
    instance_name: str | None
    attempt: int
    n_tokens: int
    finish_reason: str | None
    segment_at: datetime
    checksum: str | None = Field(description="the published checksum of `version` (None: version 0, or none given)")
    location: str | None
    published_at: datetime | None
    published_by_step: int | None = Field(description="the training step whose publish made `version`")
    reward: float | None
    reward_metrics: dict[str, float] | None
    reward_attempt: int
    scorer_token_id: int | None = Field(description="the API token that posted the reward (None: in-process)")
    scorer_name: str | None
    scorer_role: str | None


class LineageOut(Out):
    run_id: int
    step: int
    rows: list[LineageRow]


class ExportRow(Out):
    """One sample of a run with its rollout, as `staleflow export` writes it."""

    sample_id: int
    group_id: int
    idx: int
    client_key: str
    prompt_tokens: list[int]
    state: str
    reason: str | None
    group_state: str
    step: int | None = Field(description="the step that trained it (None: not trained)")
    v_traj: int | None
    staleness: int | None = Field(description="step - V_traj")
    reward: float | None
    reward_metrics: dict[str, float] | None
    reward_token_id: int | None
    finish_reason: str | None
    n_tokens: int
    response_tokens: list[int]
    logprobs: list[float]
    loss_mask: list[int] = Field(description="per response token: 1 generated, 0 an environment observation")
    token_versions: list[int | None] = Field(description="per response token: the version that generated it")
    seg_lengths: list[int]
    seg_versions: list[int | None]
    seg_instances: list[int]
    enqueued_at: datetime
    first_segment_at: datetime | None
    last_segment_at: datetime | None
    group_finished_at: datetime | None
    updated_at: datetime


class ExportPage(Out):
    rows: list[ExportRow]
    next_after: int | None = Field(description="pass as `after` for the next page; None: this was the last")
