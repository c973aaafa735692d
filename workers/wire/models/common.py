"""Field types shared by the request and response models.

Bounds mirror the database column types (int4, int8, text without NUL, jsonb), so input the
database would reject is refused with a 422 before any transaction starts.

Types are strict: a request field meant as an integer takes a JSON integer only (not "4",
4.0 or true), a boolean only true/false, a float any JSON number (an integer included) but
not a string or a boolean (pydantic's strict float, validated in Rust: a per-element Python
validator made a 2,048-token report's log-probs cost ~45x more to validate). Request models
use these aliases (`Int`, `Bool`, `Number` and the bounded ones below) for every scalar
field; a test walks every request model to check it.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict

from ..packed import KEPT_LOGPROBS, KEPT_TOKEN_IDS

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
# Strict float: int and float in, bool and str refused (pydantic >= 2.0 in both JSON and Python mode).
Number = Annotated[float, Strict()]

Id = Annotated[int, Strict(), Field(ge=1, le=INT64_MAX)]
Count = Annotated[int, Strict(), Field(ge=0, le=INT32_MAX)]
Version = Annotated[int, Strict(), Field(ge=0, le=INT32_MAX)]
Attempt = Annotated[int, Strict(), Field(ge=0, le=INT32_MAX)]
TokenId = Annotated[int, Strict(), Field(ge=0, le=INT32_MAX)]
# float4 column: finite and inside its range.
# Bounds are published as JSON Schema's minimum/maximum (pydantic's own schema).
LogProb = Annotated[float, Strict(), Field(ge=-3.0e38, le=3.0e38, allow_inf_nan=False)]
Finite = Annotated[float, Strict(), Field(ge=-1e300, le=1e300, allow_inf_nan=False)]
# Arrays of them: a JSON list, or packed (base64 of little-endian int32 / float32, see ..packed),
# kept packed (a PackedArray) for the data layer to store as it is
TokenIds = Annotated[list[TokenId], KEPT_TOKEN_IDS]
LogProbs = Annotated[list[LogProb], KEPT_LOGPROBS]
LeaseSeconds = Annotated[float, Strict(), Field(ge=1.0, le=3600.0, allow_inf_nan=False)]  # an instance's lease
ClaimSeconds = Annotated[float, Strict(), Field(ge=1.0, le=3600.0, allow_inf_nan=False)]  # a reward claim's
# A query parameter (a string on the wire, so not strict); bodies use Int with bounds.
Limit = Annotated[int, Field(ge=1, le=10_000)]

_NO_NUL = r"^[^\x00]*$"  # PostgreSQL text cannot hold NUL


Name = Annotated[str, Field(min_length=1, max_length=200, pattern=_NO_NUL)]
# A client key: no NUL, and not starting with "~" (the data layer enqueues a filtered group's
# prompt again as `~r<depth>:<key>`, so that namespace is reserved and refused here as well).
Key = Annotated[str, Field(min_length=1, max_length=500, pattern=r"^[^~\x00][^\x00]*$")]
Location = Annotated[str, Field(min_length=1, max_length=2000, pattern=_NO_NUL)]

MAX_META_BYTES = 64 * 1024


def _check_json(value: Any, depth: int = 0) -> None:
    """jsonb refuses NUL in strings and non-finite numbers; bound the depth as well."""
    if depth > 16:
        raise ValueError("nested deeper than 16 levels")
    if isinstance(value, str):
        if "\x00" in value:
            raise ValueError("strings may not contain NUL")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("numbers must be finite")
    elif isinstance(value, int) and not isinstance(value, bool):
        if abs(value) > 10**30:
            raise ValueError("integer too large")
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_json(k, depth + 1)
            _check_json(v, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _check_json(v, depth + 1)


def _valid_meta(value: dict[str, Any]) -> dict[str, Any]:
    _check_json(value)
    if len(repr(value)) > MAX_META_BYTES:
        raise ValueError(f"over {MAX_META_BYTES} bytes")
    return value


# Free-form JSON object carried with a prompt (and given back to reward workers and trainers).
Meta = Annotated[dict[str, Any], AfterValidator(_valid_meta)]


class In(BaseModel):
    """Request bodies: unknown fields are refused, so a typo is a 422, not a silent default."""

    model_config = ConfigDict(extra="forbid")


class Out(BaseModel):
    pass


class ErrorDetail(Out):
    code: str = Field(description="machine-readable: invalid_input, too_large, not_found, conflict, ...")
    message: str
    items: list[dict[str, Any]] | None = Field(None, description="conflict: the ids refused and why")
    details: list[dict[str, Any]] | None = Field(None, description="validation: each field refused")


class ErrorOut(Out):
    error: ErrorDetail


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for the error statuses an endpoint can answer."""
    return {s: {"model": ErrorOut} for s in statuses}


class DropsOut(Out):
    """The reply to a drop (a rollout instance's env drop or a reward worker's reward drop)."""

    dropped: list[int] = Field(description="samples aborted by this call (a retry of a drop returns none)")
