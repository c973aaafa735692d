"""StaleFlow REST API: FastAPI over the PostgreSQL data layer (`staleflow_db`)."""

from __future__ import annotations


def create_app(settings=None):
    from .app import create_app as _create

    return _create(settings)
