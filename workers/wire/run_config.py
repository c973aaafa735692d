"""A run's configuration, defined once: the fields, their bounds, defaults and meaning.

Everything else is derived from `RunConfig`: the API's `RunConfigIn` / `RunConfigOut`
(`models.runs`, fields, bounds and defaults), the database's view of a run
(`staleflow_db.protocol.core.RunRow` and `RUN_COLUMNS`, which the named queries select) and
the placement rules' limits (`staleflow_db.rules.Limits`). tests/api/test_run_config.py
checks the derivations against the `runs` table (staleflow_db/schema.py) and the OpenAPI
schema, so a field added here and not there (or there and not here) fails.

Stdlib only, as the rest of `workers.wire` (stdlib and pydantic): a worker node imports it
without the database.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Spec:
    """What a field means and allows: the API publishes and checks it, `problems` checks it in
    process. `ge`/`le`: its bounds (None: a flag); `defaults_to`: left out (None, or 0 in
    process) it takes that field's value."""

    description: str
    ge: float | None = None  # an int for int fields
    le: float | None = None
    symbol: str = ""  # the paper's letter (B, N ...), named in refusals
    defaults_to: str | None = None

    def label(self, name: str) -> str:
        return f"{name} ({self.symbol})" if self.symbol else name


def _spec(description: str, **kw: Any) -> dict[str, Spec]:
    return {"spec": Spec(description, **kw)}


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A run's protocol configuration. Fields in the `runs` table's column order."""

    batch_size: int = field(metadata=_spec("B: groups per training batch", ge=1, le=1_000_000, symbol="B"))
    buffer_capacity: int = field(
        default=0,
        metadata=_spec(
            "B' >= B (batch-level redundancy); left out, B", ge=1, le=1_000_000, symbol="B'", defaults_to="batch_size"
        ),
    )
    group_size: int = field(metadata=_spec("N: responses per prompt group", ge=1, le=65_535, symbol="N"))
    samples_per_group: int = field(
        default=0,
        metadata=_spec(
            "N' >= N (group-level redundancy); left out, N", ge=1, le=32_767, symbol="N'", defaults_to="group_size"
        ),
    )
    eta: int = field(metadata=_spec("staleness bound", ge=0, le=1_000_000))
    max_response_tokens: int = field(default=1024, metadata=_spec("response tokens per sample", ge=1, le=INT32_MAX))
    max_prompt_tokens: int = field(default=1024, metadata=_spec("prompt tokens per group", ge=1, le=INT32_MAX))
    dapo_filter: bool = field(default=False, metadata=_spec("drop groups whose N rewards are all equal (DAPO)"))
    # sampling: the rollout engines sample with these and the trainers take the log-probs of
    # logits / temperature (the engines' log-probs are of that distribution)
    temperature: float = field(
        default=1.0, metadata=_spec("sampling temperature (> 0; the log-probs are of logits / T)", ge=0.01, le=100.0)
    )
    top_p: float = field(
        default=1.0, metadata=_spec("nucleus sampling: the smallest token set of this mass", ge=0.01, le=1.0)
    )

    def __post_init__(self) -> None:
        # B' and N' left out (0, or None as the API passes them) are B and N, filled in here so
        # readers see ints
        for f in CONFIG_FIELDS:
            spec = SPECS[f]
            if spec.defaults_to is not None and not getattr(self, f):
                object.__setattr__(self, f, getattr(self, spec.defaults_to))

    def problems(self) -> list[str]:
        """What is wrong with this configuration, in words; empty when valid."""
        problems = []
        for f in CONFIG_FIELDS:
            spec, value = SPECS[f], getattr(self, f)
            if spec.ge is not None and value < spec.ge:
                problems.append(f"{spec.label(f)} must be >= {spec.ge}")
            if spec.le is not None and value > spec.le:
                problems.append(f"{spec.label(f)} must be <= {spec.le}")
        if self.buffer_capacity < self.batch_size:
            problems.append("buffer_capacity (B') must be >= batch_size (B)")
        if self.samples_per_group < self.group_size:
            problems.append("samples_per_group (N') must be >= group_size (N)")
        if self.dapo_filter and self.group_size < 2:
            # one reward is always "all equal": the filter would drop every group, nothing trains
            problems.append("dapo_filter needs group_size (N) >= 2")
        return problems

    def validate(self) -> None:
        """ValueError naming every problem (the data layer raises it as InvalidInput)."""
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))

    def as_dict(self) -> dict[str, int | bool | float]:
        """The configuration's fields by name (a subclass's own fields left out)."""
        return {f: getattr(self, f) for f in CONFIG_FIELDS}


CONFIG_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RunConfig))
SPECS: dict[str, Spec] = {f.name: f.metadata["spec"] for f in dataclasses.fields(RunConfig)}
TYPES: dict[str, type] = {"int": int, "bool": bool, "float": float}
FIELD_TYPES: dict[str, type] = {f.name: TYPES[str(f.type)] for f in dataclasses.fields(RunConfig)}
REQUIRED: frozenset[str] = frozenset(
    f.name
    for f in dataclasses.fields(RunConfig)
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
)


def default(name: str) -> Any:
    """The field's default in process (required fields have none)."""
    return {f.name: f.default for f in dataclasses.fields(RunConfig)}[name]
