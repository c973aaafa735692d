"""A run's lineage and its rollouts for export: read-only, for observers and admins."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query

from workers.wire.enums import Role
from workers.wire.models import ExportPage, LineageOut, errors

from ..auth import Principal
from ..body import ModelBodyRoute
from ..deps import RunId, State, allow_run

router = APIRouter(route_class=ModelBodyRoute, prefix="/v1", tags=["audit"], responses=errors(401, 403, 404, 422, 503))
Reader = Depends(allow_run(Role.OBSERVER))  # admins pass every role check


@router.get("/runs/{run_id}/lineage", response_model=LineageOut)
def lineage(
    run_id: RunId,
    state: State,
    step: Annotated[int, Query(ge=0, le=2**31 - 1, description="the trained step")],
    sample: Annotated[int | None, Query(ge=1, le=2**63 - 1, description="only this sample")] = None,
    who: Principal = Reader,
) -> LineageOut:
    """`trained_lineage` of a trained step: per segment of each sample its model version and
    instance, that version's published checksum and location, the reward, its metrics and the
    token that posted it. 404 when the step (or the sample at it) did not train."""
    rows = state.protocol.reads.lineage(run_id, step, sample)
    return LineageOut.model_validate({"run_id": run_id, "step": step, "rows": rows})


@router.get("/runs/{run_id}/export", response_model=ExportPage)
def export(
    run_id: RunId,
    state: State,
    after: Annotated[int, Query(ge=0, le=2**63 - 1, description="the last sample id of the previous page")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    trained: Annotated[bool, Query(description="only trained samples")] = False,
    who: Principal = Reader,
) -> ExportPage:
    """A page of the run's rollouts in sample id order (keyset: `after` is the previous page's
    `next_after`), each with its tokens, log-probs, loss mask, versions, reward and timings."""
    rows = state.protocol.reads.export_page(run_id, after, limit, trained)
    nxt = rows[-1]["sample_id"] if len(rows) == limit else None
    return ExportPage.model_validate({"rows": rows, "next_after": nxt})
