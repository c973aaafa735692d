"""StaleFlow REST API: FastAPI over the PostgreSQL data layer (`staleflow_db`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI

    from .settings import ApiSettings


def create_app(settings: ApiSettings | None = None) -> FastAPI:
    from .app import create_app as _create

    return _create(settings)
