"""Plain values passed in and out of protocol operations (shared by the database
implementation and the reference model). The run configuration is `workers.wire.run_config`'s
`RunConfig`, re-exported here."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass

from workers.wire.enums import GroupState, SegmentKind
from workers.wire.run_config import RunConfig
from workers.wire.types import RouteOutcome

from .errors import InvalidInput

__all__ = ["GroupOutcome", "Report", "RouteResult", "RunConfig", "check_config"]


def check_config(config: RunConfig) -> None:
    """InvalidInput naming every problem of `config` (`RunConfig.problems`): the refusal of a
    run's creation, in the database and in the reference model alike."""
    problems = config.problems()
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
    version: int | None  # the model version that generated the tokens; None for an observation
    # lists, or arrays as a request carried them packed (workers.wire.packed.PackedArray: stored
    # as they are, staleflow_db/payloads.py)
    tokens: Sequence[int]
    logprobs: Sequence[float]
    kind: SegmentKind = SegmentKind.FINISHED
    finish_reason: str | None = None
    # False: an environment observation appended between turns (multi-turn): no version, no
    # log-probs (stored as 0), loss mask 0
    generated: bool = True
    _: KW_ONLY
    instance_id: int
    route_token: str

    def check_shape(self) -> None:
        if not self.generated:
            if self.version is not None or self.logprobs or not self.tokens:
                raise InvalidInput(
                    f"sample {self.sample_id}: an observation has tokens and neither a version nor log-probs"
                )
            if self.kind == SegmentKind.FINISHED:
                raise InvalidInput(f"sample {self.sample_id}: an observation cannot finish a trajectory")
            return
        if self.version is None:
            raise InvalidInput(f"sample {self.sample_id}: a generated segment needs the version that generated it")
        if len(self.tokens) != len(self.logprobs):
            raise InvalidInput(f"sample {self.sample_id}: {len(self.tokens)} tokens but {len(self.logprobs)} log-probs")

    def stored_logprobs(self) -> Sequence[float]:
        """What the segment keeps: an observation's tokens were not sampled (log-prob 0)."""
        return self.logprobs if self.generated else [0.0] * len(self.tokens)

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
