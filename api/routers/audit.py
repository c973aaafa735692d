"""The audit views as JSON: what trained at each step with what staleness, what was dropped and
why, and every invariant violation (an empty list is the healthy answer)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query

from staleflow_db.enums import Role

from ..auth import Principal
from ..deps import Offset, Page, State, allow, run_filter
from ..models import DroppedSamples, TrainedSamples, Violations, errors

router = APIRouter(prefix="/v1/audit", tags=["audit"], responses=errors(401, 403, 422, 503))
Auditor = Depends(allow(Role.COORDINATOR, Role.TRAINER, Role.OBSERVER))
RunFilter = Annotated[int | None, Query(ge=1, le=2**63 - 1, description="only this run")]


@router.get("/trained", response_model=TrainedSamples)
def trained(
    state: State,
    run_id: RunFilter = None,
    limit: Page = 1000,
    offset: Offset = 0,
    who: Principal = Auditor,
) -> TrainedSamples:
    """`trained_samples`: per trained sample its step, V_traj, staleness and segment versions."""
    return TrainedSamples.model_validate(
        {"rows": state.protocol.audit("trained", run_filter(who, run_id), limit, offset)}
    )


@router.get("/dropped", response_model=DroppedSamples)
def dropped(
    state: State,
    run_id: RunFilter = None,
    limit: Page = 1000,
    offset: Offset = 0,
    who: Principal = Auditor,
) -> DroppedSamples:
    """`dropped_samples`: every aborted sample with its reason."""
    return DroppedSamples.model_validate(
        {"rows": state.protocol.audit("dropped", run_filter(who, run_id), limit, offset)}
    )


@router.get("/violations", response_model=Violations)
def violations(
    state: State,
    run_id: RunFilter = None,
    limit: Page = 1000,
    offset: Offset = 0,
    who: Principal = Auditor,
) -> Violations:
    """`staleness_violations`: broken invariants (bound, capacity, versions, contiguity, loss)."""
    return Violations.model_validate(
        {"rows": state.protocol.audit("violations", run_filter(who, run_id), limit, offset)}
    )
