"""Every durable fact of StaleFlow, as SQLAlchemy Core tables.

The Alembic migrations create exactly this (a test compares them); the audit views and the
append-only trigger live in the migrations as SQL (`staleflow_db/sql/`).
"""

from __future__ import annotations

import enum
from datetime import datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Double,
    Enum,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    SmallInteger,
    Table,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID

from workers.wire.enums import CommandKind, CommandState, GroupState, InstanceState, Role, RunState, SampleState

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s",
        "pk": "pk_%(table_name)s",
    }
)


def _enum(py_enum: type[enum.Enum], name: str) -> Enum:
    return Enum(py_enum, name=name, values_callable=lambda e: [m.value for m in e], create_constraint=False)


sample_state = _enum(SampleState, "sample_state")
group_state = _enum(GroupState, "group_state")
instance_state = _enum(InstanceState, "instance_state")
command_kind = _enum(CommandKind, "command_kind")
command_state = _enum(CommandState, "command_state")
role = _enum(Role, "token_role")
run_state = _enum(RunState, "run_state")


def _created() -> Column[datetime]:
    return Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now())


runs = Table(
    "runs",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("name", Text, nullable=False, unique=True),
    Column("batch_size", Integer, nullable=False),
    Column("buffer_capacity", Integer, nullable=False),
    Column("group_size", Integer, nullable=False),
    Column("samples_per_group", Integer, nullable=False),
    Column("eta", Integer, nullable=False),
    Column("max_response_tokens", Integer, nullable=False),
    Column("max_prompt_tokens", Integer, nullable=False),
    Column("dapo_filter", Boolean, nullable=False),
    Column("temperature", Double, nullable=False, server_default="1"),
    Column("top_p", Double, nullable=False, server_default="1"),
    Column("version", Integer, nullable=False, server_default="0"),
    _created(),
    Column("state", run_state, nullable=False, server_default=RunState.ACTIVE.value),
    Column("state_reason", Text),  # why it was paused or cancelled (by whom, as the caller said)
    CheckConstraint("batch_size >= 1 AND group_size >= 1 AND eta >= 0", name="positive"),
    CheckConstraint("buffer_capacity >= batch_size AND samples_per_group >= group_size", name="redundancy"),
    CheckConstraint("version >= 0", name="version"),
    CheckConstraint("temperature > 0 AND top_p > 0 AND top_p <= 1", name="sampling"),
    CheckConstraint("state <> 'cancelled' OR state_reason IS NOT NULL", name="cancel_has_reason"),
)

prompt_groups = Table(
    "prompt_groups",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("client_key", Text, nullable=False),
    Column("prompt_tokens", ARRAY(Integer), nullable=False),
    Column("meta", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("state", group_state, nullable=False, server_default=GroupState.QUEUED.value),
    Column("reserved_buffer", Integer),
    Column("min_version", Integer),  # group version of its live members at its latest route (rules.group_version)
    Column("buffer", Integer),  # the buffer it was occupied in (its training step)
    Column("group_version", Integer),  # min V_traj of its N trained members
    Column("reason", Text),
    Column("replacement_of", BigInteger, ForeignKey("prompt_groups.id")),
    _created(),
    Column("finished_at", DateTime(timezone=True)),
    UniqueConstraint("run_id", "client_key"),
    CheckConstraint("(state = 'reserved') = (reserved_buffer IS NOT NULL)", name="reserved_has_buffer"),
    CheckConstraint(
        "(state IN ('occupied', 'consumed')) = (buffer IS NOT NULL AND group_version IS NOT NULL)",
        name="occupied_has_buffer",
    ),
    CheckConstraint("state NOT IN ('filtered', 'aborted') OR reason IS NOT NULL", name="drop_has_reason"),
    Index("ix_prompt_groups_reserved", "run_id", "reserved_buffer", postgresql_where=text("state = 'reserved'")),
    Index("ix_prompt_groups_occupied", "run_id", "buffer", postgresql_where=text("state = 'occupied'")),
)

instances = Table(
    "instances",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("name", Text, nullable=False),
    Column("state", instance_state, nullable=False, server_default=InstanceState.ACTIVE.value),
    Column("version", Integer, nullable=False),
    Column("lease_expires_at", DateTime(timezone=True), nullable=False),
    # seconds a renewal extends the lease by (registration, heartbeat; any poll or report renews)
    Column("lease_s", Double, nullable=False, server_default=text("30")),
    Column("snapshot", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("snapshot_at", DateTime(timezone=True)),
    # The API token that registered it (NULL: registered in-process); only it (or an admin of
    # the run) may act for the instance over the API.
    Column("token_id", BigInteger, ForeignKey("api_tokens.id", ondelete="SET NULL")),
    _created(),
    # A run's live instances (the coordinator's reads, lease sweeps). A statement that names its
    # instances by id compares the state as text (`state::text = 'active'`), which cannot match
    # this predicate: the planner then takes the primary key whatever the statistics say. A
    # generic plan made on a young run's statistics (this index nearly empty) read the run's
    # every entry, or the whole index, for each id, per call, until the next ANALYZE
    # (tests/db/test_statement_plans.py).
    Index("ix_instances_active", "run_id", postgresql_where=text("state = 'active'")),
)

samples = Table(
    "samples",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("group_id", BigInteger, ForeignKey("prompt_groups.id", ondelete="CASCADE"), nullable=False),
    Column("idx", SmallInteger, nullable=False),
    Column("state", sample_state, nullable=False, server_default=SampleState.QUEUED.value),
    Column("v_traj", Integer),
    Column("attempt", Integer, nullable=False, server_default="0"),  # number of the route (guessable)
    Column("route_token", UUID(as_uuid=True)),  # secret token of the latest route; reports must quote it
    Column("instance_id", BigInteger, ForeignKey("instances.id")),
    Column("delivered", Boolean, nullable=False, server_default=text("false")),
    Column("n_tokens", Integer, nullable=False, server_default="0"),
    Column("n_segments", Integer, nullable=False, server_default="0"),
    Column("last_version", Integer),  # version of its latest segment
    Column("finish_reason", Text),
    Column("reward", Double),
    Column("reward_attempt", Integer, nullable=False, server_default="0"),
    Column("reward_deadline", DateTime(timezone=True)),
    Column("reason", Text),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    # the reward's extra metrics as the reward worker posted them ({"name": number}); NULL: none
    Column("reward_metrics", JSONB),
    # the API token that posted the reward (the lineage's scorer); NULL: recorded in-process
    Column("reward_token_id", BigInteger, ForeignKey("api_tokens.id", ondelete="SET NULL")),
    UniqueConstraint("group_id", "idx"),
    CheckConstraint("(state = 'running') = (instance_id IS NOT NULL)", name="running_has_instance"),
    CheckConstraint("state <> 'aborted' OR reason IS NOT NULL", name="abort_has_reason"),
    CheckConstraint("state <> 'rewarded' OR reward IS NOT NULL", name="rewarded_has_reward"),
    CheckConstraint("(state = 'scoring') = (reward_deadline IS NOT NULL)", name="scoring_has_deadline"),
    CheckConstraint("state IN ('queued', 'aborted') OR v_traj IS NOT NULL", name="routed_has_version"),
    Index("ix_samples_queued", "run_id", "id", postgresql_where=text("state = 'queued'")),
    Index("ix_samples_finished", "run_id", "id", postgresql_where=text("state = 'finished'")),
    Index("ix_samples_scoring", "run_id", "reward_deadline", postgresql_where=text("state = 'scoring'")),
    # `delivered` in the key: a poll finds the few undelivered among an instance's running (0020).
    # Samples named by id compare `state::text = 'running'`, as instances by id (above).
    Index("ix_samples_running", "instance_id", "delivered", postgresql_where=text("state = 'running'")),
    postgresql_with={"fillfactor": "70"},
)

# One object of the payload store: finished segments' packed payloads (staleflow_db/payload_store.py).
payload_objects = Table(
    "payload_objects",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("url", Text, nullable=False, unique=True),
    Column("size_bytes", BigInteger, nullable=False),
    Column("sha256", Text, nullable=False),
    _created(),
)

segments = Table(
    "segments",
    metadata,
    Column("sample_id", BigInteger, ForeignKey("samples.id", ondelete="CASCADE"), nullable=False),
    Column("seq", Integer, nullable=False),
    Column("run_id", BigInteger, nullable=False),
    Column("version", Integer),  # the model version that generated it; NULL for an observation
    Column("instance_id", BigInteger, nullable=False),
    Column("attempt", Integer, nullable=False),
    # packed little-endian int32 / float32, 4 bytes per token (staleflow_db/payloads.py); NULL
    # once moved to the payload store (staleflow_db/payload_store.py)
    Column("token_ids", LargeBinary),
    Column("logprobs", LargeBinary),
    Column("n_tokens", Integer, nullable=False),
    Column("payload_object", BigInteger, ForeignKey("payload_objects.id")),
    Column("payload_offset", BigInteger),
    Column("finish_reason", Text),
    # the loss mask of its tokens: false for an environment observation (multi-turn)
    Column("generated", Boolean, nullable=False, server_default=text("true")),
    _created(),
    PrimaryKeyConstraint("sample_id", "seq"),
    CheckConstraint(
        "n_tokens >= 0 AND octet_length(token_ids) = 4 * n_tokens AND octet_length(logprobs) = 4 * n_tokens",
        name="aligned",
    ),
    CheckConstraint(
        "(token_ids IS NULL) = (payload_object IS NOT NULL) AND (logprobs IS NULL) = (token_ids IS NULL)"
        " AND (payload_offset IS NULL) = (payload_object IS NULL) AND coalesce(payload_offset, 0) >= 0",
        name="placed",
    ),
    # one key per run: B-tree deduplication keeps an entry to a few bytes per resident segment
    Index("ix_segments_resident", "run_id", postgresql_where=text("token_ids IS NOT NULL")),
    CheckConstraint("generated = (version IS NOT NULL)", name="observation_unversioned"),
    # a checkpoint's row (~3.9 KB at 480 tokens) stays whole in the heap, two to a page (0021)
    postgresql_with={"toast_tuple_target": "4080"},
)

buffers = Table(
    "buffers",
    metadata,
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("idx", Integer, nullable=False),
    Column("batch_size", Integer, nullable=False),
    Column("capacity", Integer, nullable=False),
    Column("occupied", Integer, nullable=False, server_default="0"),
    Column("reserved", Integer, nullable=False, server_default="0"),
    # the consume fence: bumped by every consume; publish must quote the latest
    Column("consume_fence", Integer, nullable=False, server_default="0"),
    Column("consume_fence_at", DateTime(timezone=True)),
    Column("consumed_at", DateTime(timezone=True)),
    _created(),
    PrimaryKeyConstraint("run_id", "idx"),
    CheckConstraint("occupied >= 0 AND reserved >= 0", name="non_negative"),
    CheckConstraint("occupied + reserved <= capacity", name="capacity"),
    CheckConstraint("occupied <= batch_size", name="batch"),
    CheckConstraint("consumed_at IS NULL OR occupied = batch_size", name="consumed_full"),
)

commands = Table(
    "commands",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("instance_id", BigInteger, ForeignKey("instances.id", ondelete="CASCADE"), nullable=False),
    Column("kind", command_kind, nullable=False),
    Column("sample_id", BigInteger, ForeignKey("samples.id", ondelete="CASCADE")),
    Column("attempt", Integer),  # the route attempt an interrupt/abort is aimed at
    Column("target_version", Integer),  # for pull
    Column("state", command_state, nullable=False, server_default=CommandState.PENDING.value),
    Column("epoch", BigInteger),  # coordinator leadership epoch that issued it
    _created(),
    Column("delivered_at", DateTime(timezone=True)),
    Index("ix_commands_pending", "instance_id", "id", postgresql_where=text("state = 'pending'")),
)

param_versions = Table(
    "param_versions",
    metadata,
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("version", Integer, nullable=False),
    Column("size_bytes", BigInteger),
    Column("checksum", Text),
    Column("location", Text),
    _created(),
    # what the trainer reported of the step that trained this version (loss, metrics)
    Column("train_metrics", JSONB),
    PrimaryKeyConstraint("run_id", "version"),
)

# The event log's rows (migration 0016): a single event, or a fold of n >= 2 events of one kind
# written by one statement (arrays, an array NULL when all its elements are; `data` the JSON
# array of their data). The view `events` unnests them: every reader reads `events`.
event_rows = Table(
    "event_rows",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("kind", Text, nullable=False),
    Column("sample_id", BigInteger),
    Column("group_id", BigInteger),
    Column("buffer", Integer),
    Column("instance_id", BigInteger),
    Column("data", JSONB),
    Column("n", Integer),
    Column("sample_ids", ARRAY(BigInteger)),
    Column("group_ids", ARRAY(BigInteger)),
    Column("buffers", ARRAY(Integer)),
    Column("instance_ids", ARRAY(BigInteger)),
    # the names of the table before 0016 (renamed to event_rows)
    Index("ix_events_run", "run_id", "id"),
    # a group's Occupy by group: the consume's trained-once check, the audit's `trained_once`
    # (group_occupied is never folded)
    Index("ix_events_group_occupied", "run_id", "group_id", postgresql_where=text("kind = 'group_occupied'")),
    # a run's folds of one kind, for a reader of that kind through the view
    Index("ix_event_rows_folds", "run_id", "kind", postgresql_where=text("n IS NOT NULL")),
)

# The coordinator's snapshot as changes (migration 0019): per statement that changed in-flight
# samples or queued rows' group fields, their ids and the writer's transaction id (xid8 as
# bigint), written by statement triggers; a read asks for those its previous snapshot did not see.
snapshot_changes = Table(
    "snapshot_changes",
    metadata,
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column(
        "xid",
        BigInteger,
        nullable=False,
        server_default=text("CAST(CAST(pg_current_xact_id() AS text) AS bigint)"),
    ),
    Column("at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("sample_ids", ARRAY(BigInteger)),
    Column("group_ids", ARRAY(BigInteger)),
    Index("ix_snapshot_changes_run_id_xid", "run_id", "xid"),
)

# per run, the least xid a delta may start from (changes below it were pruned)
snapshot_horizons = Table(
    "snapshot_horizons",
    metadata,
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("pruned_below", BigInteger, nullable=False),
)

# the run's leader epoch: who leads its coordinator, under which epoch, until when
leader_epochs = Table(
    "leader_epochs",
    metadata,
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("holder", Text, nullable=False),
    Column("epoch", BigInteger, nullable=False),
    Column("expires_at", DateTime(timezone=True), nullable=False),
)

coordinator_cycles = Table(
    "coordinator_cycles",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("epoch", BigInteger, nullable=False),
    Column("at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("snapshot_ms", Double, nullable=False),
    Column("decide_ms", Double, nullable=False),
    Column("write_ms", Double, nullable=False),
    Column("routed", Integer, nullable=False),
    Column("interrupted", Integer, nullable=False),
    Column("pulled", Integer, nullable=False),
    Column("migrated", Integer, nullable=False),
    Index("ix_coordinator_cycles_run", "run_id", "id"),
)

api_tokens = Table(
    "api_tokens",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("token_hash", Text, nullable=False, unique=True),
    Column("role", role, nullable=False),
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE")),  # NULL: every run
    Column("name", Text),
    _created(),
    Column("revoked_at", DateTime(timezone=True)),
)

# Each run's parameter-server secret: the API derives the per-role keys a PS and its clients
# authenticate with from it (staleflow_db/param_keys.py, api/auth.py); created on first use.
param_keys = Table(
    "param_keys",
    metadata,
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("secret", LargeBinary, nullable=False),
    _created(),
)

idempotency = Table(
    "idempotency",
    metadata,
    Column("request_id", Text, primary_key=True),
    Column("operation", Text, nullable=False),
    Column("response", JSONB, nullable=False),
    _created(),
)

ENUM_TYPES = {
    "sample_state": SampleState,
    "group_state": GroupState,
    "instance_state": InstanceState,
    "command_kind": CommandKind,
    "command_state": CommandState,
    "token_role": Role,
    "run_state": RunState,
}
