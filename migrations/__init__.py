"""Alembic migrations; shipped in the wheel as ``staleflow_db.migrations`` (see pyproject)."""
