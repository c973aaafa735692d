"""Settings of the workers: the REST client, the coordinator and the simulated engine.

Each class reads its own ``STALEFLOW_*`` variables (docs/settings.md); command-line options,
where a command has them, take precedence over these.
"""

from __future__ import annotations

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from staleflow_db.settings import PREFIX, StaleFlowSettings, load

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
    retry_for: float | None = Field(60.0, ge=0.0)
    # First retry delay, doubling (with jitter) up to max_backoff.
    backoff: float = Field(0.05, gt=0.0)
    max_backoff: float = Field(1.0, gt=0.0)
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
    # Sampling temperature; log-probs are of the tempered distribution the trainer expects.
    temperature: float = Field(1.0, ge=0.0)
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
