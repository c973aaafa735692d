"""The dashboard's sample browser (docs/api.md#sample-browser): `/ui/runs/{run_id}/samples`
lists a run's samples, `/ui/runs/{run_id}/samples/{sample_id}` shows one; their data come from
`GET /v1/runs/{run_id}/samples` (filtered, keyset-paged) and `.../samples/{sample_id}`.
Read-only; every role of the run may look, as on the rest of the dashboard."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Path, Query
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse

from staleflow_db.protocol.samples import SampleFilter, SampleReads
from workers.wire.models import errors

from ..body import ModelBodyRoute
from ..deps import RunId, State
from ..ui import pages
from ..ui.samples import sample_view
from .ui import PageViewer, RunViewer, _refused

router = APIRouter(route_class=ModelBodyRoute, responses=errors(401, 403, 422, 503))

INT32 = 2**31 - 1
Status = Literal["trained", "rewarded", "in_flight", "dropped"]
SampleId = Annotated[int, Path(ge=1, le=2**63 - 1, description="sample id")]


def _reads(state: State) -> SampleReads:
    return SampleReads(state.protocol.engine)


def _ordered(lo: float | None, hi: float | None, name: str) -> None:
    if lo is not None and hi is not None and lo > hi:
        raise RequestValidationError(
            [{"loc": ("query", f"{name}_min"), "msg": f"{name}_min ({lo}) is above {name}_max ({hi})", "type": "range"}]
        )


@router.get("/v1/runs/{run_id}/samples", responses=errors(404), tags=["dashboard"])
def browse(
    run_id: RunId,
    state: State,
    who: RunViewer,
    status: Annotated[list[Status] | None, Query(description="any of these (repeat the parameter)")] = None,
    step: Annotated[
        int | None, Query(ge=0, le=INT32, description="the buffer the group occupies or trained in")
    ] = None,
    reward_min: Annotated[float | None, Query(allow_inf_nan=False)] = None,
    reward_max: Annotated[float | None, Query(allow_inf_nan=False)] = None,
    staleness_min: Annotated[int | None, Query(ge=0, le=INT32)] = None,
    staleness_max: Annotated[int | None, Query(ge=0, le=INT32)] = None,
    length_min: Annotated[int | None, Query(ge=0, le=INT32, description="response tokens")] = None,
    length_max: Annotated[int | None, Query(ge=0, le=INT32, description="response tokens")] = None,
    before: Annotated[int | None, Query(ge=1, le=2**63 - 1, description="the previous page's `next_before`")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> dict[str, Any]:
    """A page of the run's samples, newest first (keyset: pass the previous page's
    `next_before` as `before`; null on the last page). A page looks at the 10 000 samples below
    `before` at most: a rare filter may give fewer rows than `limit` with a `next_before` to go
    on from. Status: `trained`, `rewarded` (waiting
    to train), `in_flight` (queued, running, finished or being scored), `dropped`. The ranges
    are inclusive; a `_min` above its `_max` is a 422 naming it."""
    _ordered(reward_min, reward_max, "reward")
    _ordered(staleness_min, staleness_max, "staleness")
    _ordered(length_min, length_max, "length")
    where = SampleFilter(
        statuses=status or None,
        step=step,
        reward_min=reward_min,
        reward_max=reward_max,
        staleness_min=staleness_min,
        staleness_max=staleness_max,
        length_min=length_min,
        length_max=length_max,
    )
    page = _reads(state).browse(run_id, where, before, limit)
    body: dict[str, Any] = jsonable_encoder({"run_id": run_id, "rows": page.rows, "next_before": page.next_before})
    return body


@router.get("/v1/runs/{run_id}/samples/{sample_id}", responses=errors(404), tags=["dashboard"])
def sample(run_id: RunId, sample_id: SampleId, state: State, who: RunViewer) -> dict[str, Any]:
    """One sample: its prompt and segments (text when the tokens are UTF-8 bytes, else ids; see
    `decoding`), turns, the model version of each segment, the timeline of its events, commands,
    interruptions and migrations, its reward with the token that posted it, and its staleness."""
    run = state.protocol.reads.get_run(run_id)
    found = _reads(state).sample(run_id, sample_id)
    head = {"id": run.id, "name": run.name, "version": run.version, "eta": run.config["eta"]}
    body: dict[str, Any] = jsonable_encoder(sample_view(head, found))
    return body


# ---- pages --------------------------------------------------------------------------------


def _page_check(run_id: int, who: Any, back: str) -> HTMLResponse | None:
    if who is None:
        return _refused(back)
    if not who.may_use_run(run_id):
        raise HTTPException(403, f"this token is limited to run {who.run_id}")
    return None


@router.get("/ui/runs/{run_id}/samples", response_class=HTMLResponse, include_in_schema=False)
def samples_page(run_id: RunId, state: State, who: PageViewer) -> HTMLResponse:
    refused = _page_check(run_id, who, f"/ui/runs/{run_id}/samples")
    if refused is not None:
        return refused
    return HTMLResponse(pages.samples_page(run_id, state.protocol.reads.get_run(run_id).name))


@router.get("/ui/runs/{run_id}/samples/{sample_id}", response_class=HTMLResponse, include_in_schema=False)
def sample_page(run_id: RunId, sample_id: SampleId, state: State, who: PageViewer) -> HTMLResponse:
    refused = _page_check(run_id, who, f"/ui/runs/{run_id}/samples/{sample_id}")
    if refused is not None:
        return refused
    return HTMLResponse(pages.sample_page(run_id, state.protocol.reads.get_run(run_id).name, sample_id))
