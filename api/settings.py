"""Service settings, read from the environment (on top of the database settings)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from staleflow_db.settings import Settings, get_settings


def _float(env: str, default: float, lo: float, hi: float) -> float:
    raw = os.environ.get(env, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{env}={raw!r}: expected a number") from None
    if not lo <= value <= hi:
        raise ValueError(f"{env}={raw!r}: expected {lo}..{hi}")
    return value


@dataclass(frozen=True)
class ApiSettings:
    db: Settings = field(default_factory=get_settings)
    # Longest a long-poll may wait; a larger `wait` is cut to this. Clients time out later.
    max_wait: float = 30.0
    # Long-polls re-check the database this often even without a wake-up (missed NOTIFY,
    # writers that bypass the API such as an in-process coordinator).
    poll_interval: float = 0.5
    # At most one NOTIFY per run per this many seconds per replica (NOTIFY takes a global lock).
    notify_debounce: float = 0.05
    # Other replicas are woken through LISTEN/NOTIFY; off means in-process wake-ups only.
    listen: bool = True
    # Token lookups are cached this long: a revoked token stops working within it.
    token_cache_seconds: float = 5.0
    max_body_bytes: int = 64 * 1024 * 1024
    # Seconds a client should wait before retrying when the database is unavailable.
    retry_after: int = 2
    # Stored outcomes of request ids are kept this long (retries come within seconds or
    # minutes); older ones are pruned in the background. 0 keeps them forever.
    idempotency_ttl: float = 3600.0
    # libpq connect timeout: an unreachable database is a prompt 503, not a hung request.
    connect_timeout: int = 5

    @classmethod
    def from_env(cls) -> ApiSettings:
        return cls(
            db=get_settings(),
            max_wait=_float("STALEFLOW_API_MAX_WAIT", 30.0, 0.0, 600.0),
            poll_interval=_float("STALEFLOW_API_POLL_INTERVAL", 0.5, 0.01, 60.0),
            notify_debounce=_float("STALEFLOW_API_NOTIFY_DEBOUNCE", 0.05, 0.0, 10.0),
            listen=os.environ.get("STALEFLOW_API_LISTEN", "1").strip().lower() not in ("0", "false", "no", "off"),
            token_cache_seconds=_float("STALEFLOW_API_TOKEN_CACHE_SECONDS", 5.0, 0.0, 3600.0),
            max_body_bytes=int(_float("STALEFLOW_API_MAX_BODY_BYTES", 64 * 1024 * 1024, 1024, 2**40)),
            idempotency_ttl=_float("STALEFLOW_API_IDEMPOTENCY_TTL", 3600.0, 0.0, 365 * 86400.0),
        )
