"""Plain values passed in and out of protocol operations (shared by the database
implementation and the reference model)."""

from __future__ import annotations

import uuid
from dataclasses import KW_ONLY, dataclass

from workers.wire.enums import GroupState, SegmentKind
from workers.wire.types import RouteOutcome

from .errors import InvalidInput


@dataclass
class RunConfig:
    batch_size: int  # B
    group_size: int  # N
    eta: int  # staleness bound
    # B' >= B (batch-level redundancy) and N' >= N (group-level redundancy). Left out (0, or None
    # as the API passes it) they are B and N, filled in at construction so readers see ints.
    buffer_capacity: int = 0
    samples_per_group: int = 0
    max_response_tokens: int = 1024
    max_prompt_tokens: int = 1024
    dapo_filter: bool = False

    def __post_init__(self) -> None:
        if not self.buffer_capacity:
            self.buffer_capacity = self.batch_size
        if not self.samples_per_group:
            self.samples_per_group = self.group_size

    def validate(self) -> None:
        problems = []
        if self.batch_size < 1:
            problems.append("batch_size (B) must be >= 1")
        if self.group_size < 1:
            problems.append("group_size (N) must be >= 1")
        if self.eta < 0:
            problems.append("eta must be >= 0")
        if self.buffer_capacity < self.batch_size:
            problems.append("buffer_capacity (B') must be >= batch_size (B)")
        if self.samples_per_group < self.group_size:
            problems.append("samples_per_group (N') must be >= group_size (N)")
        if self.dapo_filter and self.group_size < 2:
            # one reward is always "all equal": the filter would drop every group, nothing trains
            problems.append("dapo_filter needs group_size (N) >= 2")
        if self.max_response_tokens < 1 or self.max_prompt_tokens < 1:
            problems.append("token limits must be >= 1")
        if problems:
            raise InvalidInput("; ".join(problems))


@dataclass
class RouteResult:
    sample_id: int
    outcome: RouteOutcome
    attempt: int | None = None
    v_traj: int | None = None
    buffer: int | None = None
    route_token: str | None = None  # the route's secret token (for in-process callers only)


@dataclass
class Report:
    """One stretch of generation of one sample by the instance it is routed to.

    Fenced three ways: the reporting `instance_id` must be the one the sample is routed to,
    `attempt` the route's number and `route_token` the route's secret token (random, 122 bits,
    delivered only with the work): attempts are small sequential integers anyone can guess.
    """

    sample_id: int
    attempt: int
    version: int
    tokens: list[int]
    logprobs: list[float]
    kind: SegmentKind = SegmentKind.FINISHED
    finish_reason: str | None = None
    _: KW_ONLY
    instance_id: int
    route_token: str

    def check_shape(self) -> None:
        if len(self.tokens) != len(self.logprobs):
            raise InvalidInput(f"sample {self.sample_id}: {len(self.tokens)} tokens but {len(self.logprobs)} log-probs")

    def route_token_uuid(self) -> uuid.UUID:
        try:
            return uuid.UUID(str(self.route_token))
        except ValueError:
            raise InvalidInput(
                f"sample {self.sample_id}: route_token {str(self.route_token)[:50]!r} is not a route token"
            ) from None


@dataclass
class GroupOutcome:
    group_id: int
    state: GroupState
    buffer: int | None = None
    reason: str | None = None
    replacement: int | None = None
