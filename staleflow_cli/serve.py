"""``staleflow serve``: the REST API under uvicorn.

With the embedded default (no STALEFLOW_DATABASE_URL) it starts the server if needed,
migrates it, and makes sure the local user has an admin token in ``$STALEFLOW_HOME/token``
(mode 0600), which the client reads by itself. With an external database it migrates only
when asked (``--upgrade``): schema changes there are an operator's decision.

With ``--workers N`` (N > 1) the per-replica metrics of the N processes go through
prometheus_client's multiprocess mode: a private ``PROMETHEUS_MULTIPROC_DIR`` (the user's, if
set) that every worker writes and any worker's /metrics sums (api/metrics.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import typer

from staleflow_db import migrate
from staleflow_db.db import database_url, make_engine
from staleflow_db.settings import get_settings

log = logging.getLogger(__name__)


def serve(
    host: str | None = typer.Option(None, "--host", help="address to listen on [STALEFLOW_API_HOST, 127.0.0.1]"),
    port: int | None = typer.Option(None, "--port", min=0, max=65535, help="[STALEFLOW_API_PORT, 8000]"),
    workers: int | None = typer.Option(
        None, "--workers", min=1, help="uvicorn worker processes (replicas) [STALEFLOW_API_WORKERS, 1]"
    ),
    upgrade: bool | None = typer.Option(
        None, "--upgrade/--no-upgrade", help="migrate the database first (default: only the embedded one)"
    ),
    access_log: bool | None = typer.Option(None, "--access-log/--no-access-log", help="[STALEFLOW_API_ACCESS_LOG]"),
) -> None:
    """Serve the StaleFlow REST API (/v1/..., /healthz, /readyz, /metrics)."""
    import uvicorn

    from api.auth import ensure_local_token
    from api.settings import ApiSettings

    api = ApiSettings.from_env()  # validated here, so a bad variable fails before uvicorn starts
    host = host if host is not None else api.host
    port = port if port is not None else api.port
    workers = workers if workers is not None else api.workers
    access_log = access_log if access_log is not None else api.access_log
    settings = get_settings()
    embedded = settings.database_url is None
    url = database_url(settings)
    if upgrade or (upgrade is None and embedded):
        migrate.upgrade(url)
    if embedded:
        engine = make_engine(url, settings=settings)
        try:
            log.info("admin token for the local user: %s", ensure_local_token(engine, settings.home))
        finally:
            engine.dispose()
    # Every worker process reads the same database from here, embedded or not.
    os.environ["STALEFLOW_DATABASE_URL"] = url
    log.info("serving on http://%s:%s (%d worker%s)", host, port, workers, "s" if workers > 1 else "")
    with _metrics_dir(workers):
        uvicorn.run(
            "api.app:app_from_env",
            factory=True,
            host=host,
            port=port,
            workers=workers,
            access_log=access_log,
            log_level="info",
            timeout_graceful_shutdown=5,
            timeout_keep_alive=api.keep_alive,
            timeout_worker_healthcheck=WORKER_HEALTHCHECK_S,
        )


MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# uvicorn kills a worker that does not answer its ping in time (default 5 s), and a spawned
# worker answers only once it has imported this CLI again (its __main__): 10 s on a busy
# 2-core host, where the default killed and restarted every worker for ever.
WORKER_HEALTHCHECK_S = 30


@contextmanager
def _metrics_dir(workers: int) -> Iterator[None]:
    """Set PROMETHEUS_MULTIPROC_DIR for the workers when there are several. It must be in the
    environment before uvicorn spawns them: prometheus_client picks its value store when it is
    imported, and each spawned worker imports it afresh (with the app). A directory we create
    is ours alone, fresh (no counts of an earlier server) and removed at exit."""
    if os.environ.get(MULTIPROC_ENV):  # yours, also with one worker (prometheus_client reads it anyway)
        os.makedirs(os.environ[MULTIPROC_ENV], exist_ok=True)
        log.info("per-process metrics in %s (PROMETHEUS_MULTIPROC_DIR)", os.environ[MULTIPROC_ENV])
        yield
        return
    if workers == 1:
        yield
        return
    path = tempfile.mkdtemp(prefix="staleflow-metrics-")
    os.environ[MULTIPROC_ENV] = path
    try:
        yield
    finally:
        del os.environ[MULTIPROC_ENV]
        shutil.rmtree(path, ignore_errors=True)
