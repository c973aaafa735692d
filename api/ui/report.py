"""The dashboard as one static file: a finished run's report folder gets an `index.html` with
the same panels, its data inlined, viewable without the service (or any network)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi.encoders import jsonable_encoder

from staleflow_db.protocol import ProtocolReads
from staleflow_db.protocol.reads import DASHBOARD_PANELS

from .pages import run_page


def dashboard_data(reads: ProtocolReads, run_id: int) -> dict[str, Any]:
    """Every panel and the complete audit, as the live page receives them."""
    data: dict[str, Any] = jsonable_encoder(reads.dashboard(run_id, (*DASHBOARD_PANELS, "audit")))
    return data


def write_report_html(out_dir: Path, data: dict[str, Any]) -> Path:
    """Write `out_dir/index.html` from `dashboard_data(...)`; returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "index.html"
    path.write_text(run_page(data["run"]["id"], data["run"]["name"], data), encoding="utf-8")
    return path
