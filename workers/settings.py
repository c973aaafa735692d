"""Settings of every StaleFlow process, and those of the workers: the REST client, the
coordinator and the simulated engine.

Every setting is an environment variable with the ``STALEFLOW_`` prefix, validated by
pydantic-settings; docs/settings.md lists them all in one table (a unit test keeps it exact).
Empty variables count as unset. A bad value raises :class:`SettingsError` (a ``ValueError``)
naming the variable. Each class is loaded through :func:`load`, cached per content of the
``STALEFLOW_*`` environment, so it is cheap to call anywhere and a test that changes the
environment (``monkeypatch.setenv``) sees its change without clearing anything; tests may also
build a class directly with keyword overrides, which win over the environment. Command-line
options, where a command has them, take precedence over these.

The base here needs no database: the database settings (staleflow_db/settings.py) and the
API's (api/settings.py) extend it.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from workers.retry import API_OUTAGE

PREFIX = "STALEFLOW_"


def env_name(cls: type[BaseSettings], field: str) -> str:
    """The environment variable that sets `field` of `cls`."""
    alias = cls.model_fields[field].validation_alias
    if isinstance(alias, str):
        return alias
    return str(cls.model_config.get("env_prefix", "")).upper() + field.upper()


class SettingsError(ValueError):
    """Invalid settings: one line per bad variable, naming it and what it expects."""

    def __init__(self, cls: type[BaseSettings], exc: ValidationError):
        lines = []
        for err in exc.errors():
            loc = str(err["loc"][0]) if err["loc"] else ""
            name = env_name(cls, loc) if loc in cls.model_fields else loc  # else: an alias already
            raw = os.environ.get(name, err.get("input"))
            lines.append(f"{name}={raw!r}: {err['msg'].removeprefix('Value error, ')}")
        super().__init__("invalid settings:\n  " + "\n  ".join(lines))


class StaleFlowSettings(BaseSettings):
    """Base: ``STALEFLOW_`` variables, blanks ignored, immutable, errors that name the variable."""

    model_config = SettingsConfigDict(
        env_prefix=PREFIX,
        env_ignore_empty=True,
        frozen=True,
        extra="ignore",
        populate_by_name=True,
        validate_default=True,
    )

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise SettingsError(type(self), exc) from None


S = TypeVar("S", bound=StaleFlowSettings)


@lru_cache(maxsize=64)
def _cached(cls: type[S], env: tuple[tuple[str, str], ...]) -> S:
    return cls()


def load(cls: type[S]) -> S:
    """`cls` as the current environment sets it, parsed once per distinct environment."""
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(PREFIX)))
    settings: S = _cached(cls, env)  # lru_cache's wrapper types its result as Any
    return settings


class HomeSettings(StaleFlowSettings):
    """Where a process keeps local state (``STALEFLOW_HOME``): the database settings extend it,
    the REST client finds the local token there and the trainer its checkpoints."""

    # Embedded server data (`pgdata/`), the local token file and trainer checkpoints.
    home: Path = Path("~/.staleflow")

    @field_validator("home")
    @classmethod
    def _absolute(cls, home: Path) -> Path:
        return home.expanduser().absolute()


def home_dir() -> Path:
    """``STALEFLOW_HOME``, absolute."""
    return load(HomeSettings).home


DEFAULT_URL = "http://127.0.0.1:8000"


class ClientSettings(StaleFlowSettings):
    """How workers and commands reach the API (workers/client.py)."""

    model_config = SettingsConfigDict(env_prefix=PREFIX + "CLIENT_")

    # One URL, or several API replicas separated by commas (the client fails over).
    api_url: str = Field(DEFAULT_URL, validation_alias=PREFIX + "API_URL")
    # Bearer token; unset: the file `$STALEFLOW_HOME/token` that `staleflow serve` writes.
    token: str | None = Field(None, validation_alias=PREFIX + "TOKEN")
    # Seconds per request on top of a long-poll's wait; connecting gets at most 10 of them.
    timeout: float = Field(30.0, gt=0.0)
    # Seconds to retry an unavailable API per call; `forever` (or `none`) never gives up.
    # Defaults: the API_OUTAGE retry policy (workers/retry.py).
    retry_for: float | None = Field(API_OUTAGE.retry_for, ge=0.0)
    # First retry delay, doubling (with as much jitter) up to max_backoff.
    backoff: float = Field(API_OUTAGE.initial, gt=0.0)
    max_backoff: float = Field(API_OUTAGE.cap, gt=0.0)
    # Default long-poll wait of poll, claim and consume, in seconds.
    wait: float = Field(10.0, ge=0.0, le=600.0)

    @field_validator("retry_for", mode="before")
    @classmethod
    def _forever(cls, value: object) -> object:
        if isinstance(value, str) and value.strip().lower() in ("forever", "none"):
            return None
        return value

    @field_validator("api_url", "token")
    @classmethod
    def _strip(cls, value: str | None) -> str | None:
        return value.strip() if value else value


class CoordinatorSettings(StaleFlowSettings):
    """Defaults of `staleflow coordinator` (its options override them)."""

    model_config = SettingsConfigDict(env_prefix=PREFIX + "COORDINATOR_")

    # Routing policy (see docs/policies.md).
    policy: str = "staleflow"
    # Cost model (a key of workers/coordinator/cost_models.json) and its parallelism fit.
    model: str = "qwen_7b"
    parallelism: str = "TP1_PP1"
    # Seconds between cycles; unset: the policy's own (0.1).
    period: float | None = Field(None, gt=0.0)
    # Leader lease in seconds; a standby takes over after it lapses.
    lease: float = Field(3.0, gt=0.0)
    # Pulls the parameter server carries at full rate at once (its egress streams): the
    # staleflow policy keeps at most `pull_depth` pulls in flight per stream; unset: not staggered.
    ps_streams: int | None = Field(None, ge=1)


class SimEngineSettings(StaleFlowSettings):
    """The simulated engine (workers/rollout/engines/sim_engine.py), where its caller passes
    nothing explicit."""

    model_config = SettingsConfigDict(env_prefix=PREFIX + "SIM_")

    # Cost model timing the simulated GPU, and its parallelism fit.
    model: str = "qwen_7b"
    parallelism: str = "TP1_PP1"
    # Wall seconds per simulated second: 0.1 runs ten times faster than the GPUs modelled.
    time_scale: float = Field(1.0, ge=0.0)
    # Simulated seconds to load new weights.
    pull_s: float = Field(0.0, ge=0.0)
    # Prefill tokens/s charged at each admission; 0: prefill is free.
    prefill_rate: float = Field(0.0, ge=0.0)


class EngineSettings(StaleFlowSettings):
    """The rollout worker's engine (`staleflow rollout-worker`); its options win."""

    model_config = SettingsConfigDict(env_prefix=PREFIX + "ENGINE_")

    # KV-cache tokens of the torch and hf engines (the sim engine: unset means its own).
    kv_capacity: int | None = Field(None, ge=16)
    # Most samples decoding at once.
    max_running: int = Field(256, ge=1)
    # Sampling temperature: the run's is used (unset); set to another, the worker refuses to start.
    temperature: float | None = Field(None, ge=0.0)
    # torch and hf engines: torch device, e.g. cpu or cuda:0.
    device: str = "cpu"
    # Interrupt a preempted sample back to the queue when more than this many wait (unset: never).
    phi_wait: int | None = Field(None, ge=0)


def engine_settings() -> EngineSettings:
    return load(EngineSettings)


def client_settings() -> ClientSettings:
    return load(ClientSettings)


def coordinator_settings() -> CoordinatorSettings:
    return load(CoordinatorSettings)


def sim_engine_settings() -> SimEngineSettings:
    return load(SimEngineSettings)
