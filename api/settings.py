"""Service settings (``STALEFLOW_API_*``), on top of the database settings."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from staleflow_db.settings import Settings, get_settings
from workers.settings import PREFIX, StaleFlowSettings, load


class ApiSettings(StaleFlowSettings):
    model_config = SettingsConfigDict(env_prefix=PREFIX + "API_")

    # The database settings (their own variables); not read from a variable of this class.
    db: Settings = Field(default_factory=get_settings, exclude=True)
    # Longest a long-poll may wait; a larger `wait` is cut to this. Clients time out later.
    max_wait: float = Field(30.0, ge=0.0, le=600.0)
    # Long-polls re-check the database this often without a wake-up while this replica does not
    # listen (LISTEN connection down, or `listen` off): wake-ups from other replicas and from
    # writers outside the API (the in-process coordinator's NOTIFY) then reach it only this way.
    poll_interval: float = Field(0.5, ge=0.01, le=60.0)
    # ... and this often while it listens: every writer sends a wake-up, so the timer only bounds
    # what a lost NOTIFY costs. At 0.5 s the re-checks were a third of the database transactions
    # of a 64-instance run (each instance's long-poll re-checked ten times a 5-s wait).
    notified_poll_interval: float = Field(5.0, ge=0.01, le=60.0)
    # At most one NOTIFY per run per this many seconds per replica (NOTIFY takes a global lock).
    notify_debounce: float = Field(0.05, ge=0.0, le=10.0)
    # Other replicas are woken through LISTEN/NOTIFY; off means in-process wake-ups only.
    listen: bool = True
    # Token lookups are cached this long: a revoked token stops working within it.
    token_cache_seconds: float = Field(5.0, ge=0.0, le=3600.0)
    max_body_bytes: int = Field(64 * 1024 * 1024, ge=1024, le=2**40)
    # Seconds a client should wait before retrying when the database is unavailable.
    retry_after: int = Field(2, ge=0, le=3600)
    # Stored outcomes of request ids are kept this long (retries come within seconds or
    # minutes); older ones are pruned in the background. 0 keeps them forever.
    idempotency_ttl: float = Field(3600.0, ge=0.0, le=365 * 86400.0)
    # libpq connect timeout: an unreachable database is a prompt 503, not a hung request.
    connect_timeout: int = Field(5, ge=1, le=600)
    # While the database is down, it is probed this often until it answers again.
    probe_interval: float = Field(0.5, ge=0.05, le=60.0)
    # Group commit (docs/scaling.md): concurrent lease renewals, segment reports and rewards
    # of one replica share one database transaction, each call still its own outcome. Off by
    # default: on a shared 2-core machine it cut transactions per call ~6x but not the CPU per
    # call, and lowered calls/s (docs/benchmarks.md, "Group commit").
    group_commit: bool = False
    # A group's leader waits this long for company before it runs (0: never; a group forms
    # from the calls that arrive while the previous one's transaction is in flight).
    group_commit_window: float = Field(0.0, ge=0.0, le=1.0)
    # Calls per group transaction at most (one subtransaction each: PostgreSQL caches 64).
    group_commit_max: int = Field(32, ge=1, le=60)
    # Group transactions in flight at once per process.
    group_commit_lanes: int = Field(4, ge=1, le=64)
    # `staleflow serve`: where to listen, how many uvicorn worker processes (--host, --port,
    # --workers and --access-log win).
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    workers: int = Field(1, ge=1, le=256)
    access_log: bool = False
    # Idle seconds uvicorn keeps a client's connection open. Longer than any client keeps an
    # idle pooled connection (httpx: 5 s), so the client always drops it first and never
    # sends a request on a connection the server is closing at that moment (uvicorn's own
    # default, 5 s, races httpx's 5 s: a request lost as "connection closed").
    keep_alive: int = Field(30, ge=1, le=3600)

    @classmethod
    def from_env(cls) -> ApiSettings:
        return load(cls)
