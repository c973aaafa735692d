"""Initial schema: runs, groups, samples, segments, buffers, instances, commands,
parameter versions, events, coordinator lease, tokens, idempotency; audit views.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

ENUMS = ("sample_state", "group_state", "instance_state", "command_kind", "command_state", "token_role")

# Segments are history: a trainer may already have consumed them, so rows never change.
APPEND_ONLY = """
CREATE FUNCTION staleflow_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is append-only', TG_TABLE_NAME USING ERRCODE = 'restrict_violation';
END $$;
CREATE TRIGGER segments_append_only BEFORE UPDATE OR DELETE ON segments
    FOR EACH ROW WHEN (pg_trigger_depth() = 0) EXECUTE FUNCTION staleflow_append_only();
CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE ON events
    FOR EACH ROW WHEN (pg_trigger_depth() = 0) EXECUTE FUNCTION staleflow_append_only();
"""

# Hot tables: many updates per row, so leave room for HOT updates and vacuum them early.
TUNING = """
ALTER TABLE samples SET (autovacuum_vacuum_scale_factor = 0.05, autovacuum_analyze_scale_factor = 0.05);
ALTER TABLE buffers SET (fillfactor = 50, autovacuum_vacuum_scale_factor = 0.01);
ALTER TABLE runs SET (fillfactor = 50);
ALTER TABLE instances SET (fillfactor = 50);
"""

AUDIT_VIEWS = """
CREATE VIEW trained_samples AS
SELECT s.run_id,
       g.buffer AS step,
       s.id AS sample_id,
       s.group_id,
       s.idx,
       s.v_traj,
       g.buffer - s.v_traj AS staleness,
       g.group_version,
       g.buffer - g.group_version AS group_staleness,
       seg.versions AS segment_versions,
       seg.instances AS segment_instances,
       coalesce(cardinality(seg.versions), 0) AS n_segments,
       s.n_tokens,
       s.reward,
       s.finish_reason
FROM samples s
JOIN prompt_groups g ON g.id = s.group_id AND g.state = 'consumed'
LEFT JOIN LATERAL (
    SELECT array_agg(x.version ORDER BY x.seq) AS versions,
           array_agg(x.instance_id ORDER BY x.seq) AS instances
    FROM segments x WHERE x.sample_id = s.id
) seg ON true
WHERE s.state = 'rewarded';

CREATE VIEW dropped_samples AS
SELECT s.run_id, s.id AS sample_id, s.group_id, s.idx, s.reason, g.state AS group_state,
       s.v_traj, s.n_tokens, s.n_segments, s.updated_at AS dropped_at
FROM samples s JOIN prompt_groups g ON g.id = s.group_id
WHERE s.state = 'aborted';

CREATE VIEW staleness_violations AS
-- 1. every trained group and sample lies inside its window
SELECT g.run_id, 'bound' AS invariant, 'group ' || g.id AS subject,
       format('version %s in buffer %s with eta %s', g.group_version, g.buffer, r.eta) AS detail
FROM prompt_groups g JOIN runs r ON r.id = g.run_id
WHERE g.state IN ('occupied', 'consumed')
  AND NOT (g.buffer BETWEEN g.group_version AND g.group_version + r.eta)
UNION ALL
SELECT t.run_id, 'bound', 'sample ' || t.sample_id,
       format('V_traj %s trained at step %s with eta %s', t.v_traj, t.step, r.eta)
FROM trained_samples t JOIN runs r ON r.id = t.run_id
WHERE t.staleness < 0 OR t.staleness > r.eta
-- 2. buffer accounting agrees with the entries and respects capacity
UNION ALL
SELECT b.run_id, 'capacity', 'buffer ' || b.idx,
       format('occupied %s (entries %s), reserved %s (entries %s), capacity %s, B %s, consumed %s',
              b.occupied, coalesce(e.occupied, 0), b.reserved, coalesce(e.reserved, 0),
              b.capacity, b.batch_size, b.consumed_at IS NOT NULL)
FROM buffers b
LEFT JOIN (
    SELECT run_id, coalesce(buffer, reserved_buffer) AS idx,
           count(*) FILTER (WHERE state IN ('occupied', 'consumed')) AS occupied,
           count(*) FILTER (WHERE state = 'reserved') AS reserved
    FROM prompt_groups WHERE state IN ('occupied', 'consumed', 'reserved')
    GROUP BY 1, 2
) e ON e.run_id = b.run_id AND e.idx = b.idx
WHERE b.occupied <> coalesce(e.occupied, 0) OR b.reserved <> coalesce(e.reserved, 0)
   OR b.occupied + b.reserved > b.capacity
   OR (b.consumed_at IS NOT NULL AND b.occupied <> b.batch_size)
-- 3. segment versions start at V_traj and never decrease
UNION ALL
SELECT s.run_id, 'segment_version', 'sample ' || s.id,
       format('segment %s at version %s after version %s, V_traj %s', x.seq, x.version, x.prev, s.v_traj)
FROM (SELECT sample_id, seq, version, lag(version) OVER (PARTITION BY sample_id ORDER BY seq) AS prev
      FROM segments) x
JOIN samples s ON s.id = x.sample_id
WHERE x.version < s.v_traj OR x.version < x.prev
-- 4. versions are contiguous: buffers 0..version-1 consumed, none later
UNION ALL
SELECT r.id, 'contiguity', 'run ' || r.id,
       format('version %s but %s consumed buffers (max %s)', r.version, count(b.idx), max(b.idx))
FROM runs r LEFT JOIN buffers b ON b.run_id = r.id AND b.consumed_at IS NOT NULL
GROUP BY r.id, r.version
HAVING count(b.idx) <> r.version OR coalesce(max(b.idx), -1) <> r.version - 1
-- 5. nothing is lost: drops carry a reason, trained groups have exactly N members,
--    and a sample's token count is the sum of its segments
UNION ALL
SELECT s.run_id, 'lost', 'sample ' || s.id, 'aborted without a reason'
FROM samples s WHERE s.state = 'aborted' AND s.reason IS NULL
UNION ALL
SELECT g.run_id, 'lost', 'group ' || g.id, format('%s trained members, N = %s', count(s.id), r.group_size)
FROM prompt_groups g JOIN runs r ON r.id = g.run_id
LEFT JOIN samples s ON s.group_id = g.id AND s.state = 'rewarded'
WHERE g.state IN ('occupied', 'consumed')
GROUP BY g.run_id, g.id, r.group_size HAVING count(s.id) <> r.group_size
UNION ALL
SELECT s.run_id, 'lost', 'sample ' || s.id,
       format('n_tokens %s but segments hold %s', s.n_tokens, coalesce(x.n, 0))
FROM samples s
LEFT JOIN (SELECT sample_id, sum(cardinality(token_ids)) AS n FROM segments GROUP BY 1) x
       ON x.sample_id = s.id
WHERE s.n_tokens <> coalesce(x.n, 0);
"""


def upgrade() -> None:
    op.create_table(
        "idempotency",
        sa.Column("request_id", sa.Text(), nullable=False),
        sa.Column("operation", sa.Text(), nullable=False),
        sa.Column("response", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_idempotency")),
    )
    op.create_table(
        "runs",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("batch_size", sa.Integer(), nullable=False),
        sa.Column("buffer_capacity", sa.Integer(), nullable=False),
        sa.Column("group_size", sa.Integer(), nullable=False),
        sa.Column("samples_per_group", sa.Integer(), nullable=False),
        sa.Column("eta", sa.Integer(), nullable=False),
        sa.Column("max_response_tokens", sa.Integer(), nullable=False),
        sa.Column("max_prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("dapo_filter", sa.Boolean(), nullable=False),
        sa.Column("version", sa.Integer(), server_default="0", nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint("batch_size >= 1 AND group_size >= 1 AND eta >= 0", name=op.f("ck_runs_positive")),
        sa.CheckConstraint(
            "buffer_capacity >= batch_size AND samples_per_group >= group_size", name=op.f("ck_runs_redundancy")
        ),
        sa.CheckConstraint("version >= 0", name=op.f("ck_runs_version")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
        sa.UniqueConstraint("name", name=op.f("uq_runs_name")),
    )
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("token_hash", sa.Text(), nullable=False),
        sa.Column(
            "role", sa.Enum("admin", "rollout", "reward", "trainer", "coordinator", name="token_role"), nullable=False
        ),
        sa.Column("run_id", sa.BigInteger(), nullable=True),
        sa.Column("name", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_api_tokens_run_id"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_tokens")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_api_tokens_token_hash")),
    )
    op.create_table(
        "buffers",
        sa.Column("run_id", sa.BigInteger(), nullable=False),
        sa.Column("idx", sa.Integer(), nullable=False),
        sa.Column("batch_size", sa.Integer(), nullable=False),
        sa.Column("capacity", sa.Integer(), nullable=False),
        sa.Column("occupied", sa.Integer(), server_default="0", nullable=False),
        sa.Column("reserved", sa.Integer(), server_default="0", nullable=False),
        sa.Column("lease", sa.Integer(), server_default="0", nullable=False),
        sa.Column("leased_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("consumed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint("consumed_at IS NULL OR occupied = batch_size", name=op.f("ck_buffers_consumed_full")),
        sa.CheckConstraint("occupied + reserved <= capacity", name=op.f("ck_buffers_capacity")),
        sa.CheckConstraint("occupied <= batch_size", name=op.f("ck_buffers_batch")),
        sa.CheckConstraint("occupied >= 0 AND reserved >= 0", name=op.f("ck_buffers_non_negative")),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_buffers_run_id"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "idx", name=op.f("pk_buffers")),
    )
    op.create_table(
        "coordinator_cycles",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.BigInteger(), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("snapshot_ms", sa.Double(), nullable=False),
        sa.Column("decide_ms", sa.Double(), nullable=False),
        sa.Column("write_ms", sa.Double(), nullable=False),
        sa.Column("routed", sa.Integer(), nullable=False),
        sa.Column("interrupted", sa.Integer(), nullable=False),
        sa.Column("pulled", sa.Integer(), nullable=False),
        sa.Column("migrated", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_coordinator_cycles_run_id"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_coordinator_cycles")),
    )
    op.create_index("ix_coordinator_cycles_run", "coordinator_cycles", ["run_id", "id"], unique=False)
    op.create_table(
        "coordinator_leases",
        sa.Column("run_id", sa.BigInteger(), nullable=False),
        sa.Column("holder", sa.Text(), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_coordinator_leases_run_id"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", name=op.f("pk_coordinator_leases")),
    )
    op.create_table(
        "events",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.BigInteger(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("sample_id", sa.BigInteger(), nullable=True),
        sa.Column("group_id", sa.BigInteger(), nullable=True),
        sa.Column("buffer", sa.Integer(), nullable=True),
        sa.Column("instance_id", sa.BigInteger(), nullable=True),
        sa.Column("data", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_events_run_id"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
    )
    op.create_index("ix_events_run", "events", ["run_id", "id"], unique=False)
    op.create_table(
        "instances",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.BigInteger(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column(
            "state",
            sa.Enum("active", "expired", "deregistered", name="instance_state"),
            server_default="active",
            nullable=False,
        ),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column(
            "snapshot", postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False
        ),
        sa.Column("snapshot_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_instances_run_id"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_instances")),
    )
    op.create_index(
        "ix_instances_active", "instances", ["run_id"], unique=False, postgresql_where=sa.text("state = 'active'")
    )
    op.create_table(
        "param_versions",
        sa.Column("run_id", sa.BigInteger(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=True),
        sa.Column("checksum", sa.Text(), nullable=True),
        sa.Column("location", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_param_versions_run_id"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "version", name=op.f("pk_param_versions")),
    )
    op.create_table(
        "prompt_groups",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.BigInteger(), nullable=False),
        sa.Column("client_key", sa.Text(), nullable=False),
        sa.Column("prompt_tokens", postgresql.ARRAY(sa.Integer()), nullable=False),
        sa.Column(
            "meta", postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False
        ),
        sa.Column(
            "state",
            sa.Enum("queued", "reserved", "occupied", "consumed", "filtered", "aborted", name="group_state"),
            server_default="queued",
            nullable=False,
        ),
        sa.Column("reserved_buffer", sa.Integer(), nullable=True),
        sa.Column("min_version", sa.Integer(), nullable=True),
        sa.Column("buffer", sa.Integer(), nullable=True),
        sa.Column("group_version", sa.Integer(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("replacement_of", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "(state = 'reserved') = (reserved_buffer IS NOT NULL)", name=op.f("ck_prompt_groups_reserved_has_buffer")
        ),
        sa.CheckConstraint(
            "(state IN ('occupied', 'consumed')) = (buffer IS NOT NULL AND group_version IS NOT NULL)",
            name=op.f("ck_prompt_groups_occupied_has_buffer"),
        ),
        sa.CheckConstraint(
            "state NOT IN ('filtered', 'aborted') OR reason IS NOT NULL", name=op.f("ck_prompt_groups_drop_has_reason")
        ),
        sa.ForeignKeyConstraint(["replacement_of"], ["prompt_groups.id"], name=op.f("fk_prompt_groups_replacement_of")),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_prompt_groups_run_id"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_prompt_groups")),
        sa.UniqueConstraint("run_id", "client_key", name=op.f("uq_prompt_groups_run_id_client_key")),
    )
    op.create_index(
        "ix_prompt_groups_occupied",
        "prompt_groups",
        ["run_id", "buffer"],
        unique=False,
        postgresql_where=sa.text("state = 'occupied'"),
    )
    op.create_index(
        "ix_prompt_groups_reserved",
        "prompt_groups",
        ["run_id", "reserved_buffer"],
        unique=False,
        postgresql_where=sa.text("state = 'reserved'"),
    )
    op.create_table(
        "samples",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.BigInteger(), nullable=False),
        sa.Column("group_id", sa.BigInteger(), nullable=False),
        sa.Column("idx", sa.SmallInteger(), nullable=False),
        sa.Column(
            "state",
            sa.Enum("queued", "running", "finished", "scoring", "rewarded", "aborted", name="sample_state"),
            server_default="queued",
            nullable=False,
        ),
        sa.Column("v_traj", sa.Integer(), nullable=True),
        sa.Column("attempt", sa.Integer(), server_default="0", nullable=False),
        sa.Column("instance_id", sa.BigInteger(), nullable=True),
        sa.Column("delivered", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("n_tokens", sa.Integer(), server_default="0", nullable=False),
        sa.Column("n_segments", sa.Integer(), server_default="0", nullable=False),
        sa.Column("last_version", sa.Integer(), nullable=True),
        sa.Column("finish_reason", sa.Text(), nullable=True),
        sa.Column("reward", sa.Double(), nullable=True),
        sa.Column("reward_attempt", sa.Integer(), server_default="0", nullable=False),
        sa.Column("reward_deadline", sa.DateTime(timezone=True), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint(
            "(state = 'running') = (instance_id IS NOT NULL)", name=op.f("ck_samples_running_has_instance")
        ),
        sa.CheckConstraint(
            "(state = 'scoring') = (reward_deadline IS NOT NULL)", name=op.f("ck_samples_scoring_has_deadline")
        ),
        sa.CheckConstraint("state <> 'aborted' OR reason IS NOT NULL", name=op.f("ck_samples_abort_has_reason")),
        sa.CheckConstraint("state <> 'rewarded' OR reward IS NOT NULL", name=op.f("ck_samples_rewarded_has_reward")),
        sa.CheckConstraint(
            "state IN ('queued', 'aborted') OR v_traj IS NOT NULL", name=op.f("ck_samples_routed_has_version")
        ),
        sa.ForeignKeyConstraint(
            ["group_id"], ["prompt_groups.id"], name=op.f("fk_samples_group_id"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(["instance_id"], ["instances.id"], name=op.f("fk_samples_instance_id")),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_samples_run_id"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_samples")),
        sa.UniqueConstraint("group_id", "idx", name=op.f("uq_samples_group_id_idx")),
        postgresql_with={"fillfactor": "70"},
    )
    op.create_index(
        "ix_samples_finished", "samples", ["run_id", "id"], unique=False, postgresql_where=sa.text("state = 'finished'")
    )
    op.create_index("ix_samples_group", "samples", ["group_id"], unique=False)
    op.create_index(
        "ix_samples_queued", "samples", ["run_id", "id"], unique=False, postgresql_where=sa.text("state = 'queued'")
    )
    op.create_index(
        "ix_samples_running", "samples", ["instance_id"], unique=False, postgresql_where=sa.text("state = 'running'")
    )
    op.create_index(
        "ix_samples_scoring",
        "samples",
        ["run_id", "reward_deadline"],
        unique=False,
        postgresql_where=sa.text("state = 'scoring'"),
    )
    op.create_table(
        "commands",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.BigInteger(), nullable=False),
        sa.Column("instance_id", sa.BigInteger(), nullable=False),
        sa.Column("kind", sa.Enum("interrupt", "abort", "pull", name="command_kind"), nullable=False),
        sa.Column("sample_id", sa.BigInteger(), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=True),
        sa.Column("target_version", sa.Integer(), nullable=True),
        sa.Column(
            "state", sa.Enum("pending", "delivered", name="command_state"), server_default="pending", nullable=False
        ),
        sa.Column("epoch", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["instance_id"], ["instances.id"], name=op.f("fk_commands_instance_id"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_commands_run_id"), ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["sample_id"], ["samples.id"], name=op.f("fk_commands_sample_id"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_commands")),
    )
    op.create_index(
        "ix_commands_pending",
        "commands",
        ["instance_id", "id"],
        unique=False,
        postgresql_where=sa.text("state = 'pending'"),
    )
    op.create_table(
        "segments",
        sa.Column("sample_id", sa.BigInteger(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.BigInteger(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("instance_id", sa.BigInteger(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("token_ids", postgresql.ARRAY(sa.Integer()), nullable=False),
        sa.Column("logprobs", postgresql.ARRAY(postgresql.REAL()), nullable=False),
        sa.Column("finish_reason", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint("cardinality(token_ids) = cardinality(logprobs)", name=op.f("ck_segments_aligned")),
        sa.ForeignKeyConstraint(["sample_id"], ["samples.id"], name=op.f("fk_segments_sample_id"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("sample_id", "seq", name=op.f("pk_segments")),
    )
    op.execute(APPEND_ONLY)
    op.execute(TUNING)
    op.execute(AUDIT_VIEWS)


def downgrade() -> None:
    op.execute("DROP VIEW staleness_violations; DROP VIEW dropped_samples; DROP VIEW trained_samples")

    op.drop_table("segments")
    op.drop_index("ix_commands_pending", table_name="commands", postgresql_where=sa.text("state = 'pending'"))
    op.drop_table("commands")
    op.drop_index("ix_samples_scoring", table_name="samples", postgresql_where=sa.text("state = 'scoring'"))
    op.drop_index("ix_samples_running", table_name="samples", postgresql_where=sa.text("state = 'running'"))
    op.drop_index("ix_samples_queued", table_name="samples", postgresql_where=sa.text("state = 'queued'"))
    op.drop_index("ix_samples_group", table_name="samples")
    op.drop_index("ix_samples_finished", table_name="samples", postgresql_where=sa.text("state = 'finished'"))
    op.drop_table("samples")
    op.drop_index(
        "ix_prompt_groups_reserved", table_name="prompt_groups", postgresql_where=sa.text("state = 'reserved'")
    )
    op.drop_index(
        "ix_prompt_groups_occupied", table_name="prompt_groups", postgresql_where=sa.text("state = 'occupied'")
    )
    op.drop_table("prompt_groups")
    op.drop_table("param_versions")
    op.drop_index("ix_instances_active", table_name="instances", postgresql_where=sa.text("state = 'active'"))
    op.drop_table("instances")
    op.drop_index("ix_events_run", table_name="events")
    op.drop_table("events")
    op.drop_table("coordinator_leases")
    op.drop_index("ix_coordinator_cycles_run", table_name="coordinator_cycles")
    op.drop_table("coordinator_cycles")
    op.drop_table("buffers")
    op.drop_table("api_tokens")
    op.drop_table("runs")
    op.drop_table("idempotency")
    op.execute("DROP FUNCTION staleflow_append_only()")
    for name in ENUMS:
        op.execute(f"DROP TYPE {name}")
