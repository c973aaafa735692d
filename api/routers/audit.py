"""The audit views as JSON: what trained at each step with what staleness, what was dropped and
why, and every invariant violation (an empty list is the healthy answer)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query

from workers.wire.enums import Role
from workers.wire.models import DroppedSamples, TrainedSamples, Violations, errors

from ..auth import Principal
from ..body import ModelBodyRoute
from ..deps import Offset, Page, State, allow, run_filter

router = APIRouter(route_class=ModelBodyRoute, prefix="/v1/audit", tags=["audit"], responses=errors(401, 403, 422, 503))
Auditor = Depends(allow(Role.COORDINATOR, Role.TRAINER, Role.OBSERVER))
RunFilter = Annotated[int | None, Query(ge=1, le=2**63 - 1, description="only this run")]


def _audit_view(view: str, model: type[TrainedSamples | DroppedSamples | Violations], doc: str) -> None:
    """GET /v1/audit/{view}: the same run filter, paging and roles for every view; only the
    view and its row model differ."""

    def read(
        state: State,
        run_id: RunFilter = None,
        limit: Page = 1000,
        offset: Offset = 0,
        who: Principal = Auditor,
    ) -> Any:
        return model.model_validate({"rows": state.protocol.reads.audit(view, run_filter(who, run_id), limit, offset)})

    read.__doc__ = doc  # the endpoint's description in the OpenAPI schema
    router.get(f"/{view}", response_model=model, name=view)(read)


_audit_view(
    "trained", TrainedSamples, "`trained_samples`: per trained sample its step, V_traj, staleness and segment versions."
)
_audit_view("dropped", DroppedSamples, "`dropped_samples`: every aborted sample with its reason.")
_audit_view(
    "violations",
    Violations,
    "`staleness_violations`: broken invariants (bound, capacity, versions, contiguity, loss, lineage).",
)
