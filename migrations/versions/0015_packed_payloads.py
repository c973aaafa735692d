"""Packed segment payloads and the payload store.

`segments.token_ids` and `segments.logprobs` become `bytea` (little-endian int32 / float32,
4 bytes per token: `staleflow_db/payloads.py`) with the count in `segments.n_tokens`; CHECK
`aligned` is now both 4 × n_tokens bytes. Existing rows are converted in place (one table
rewrite each way). The audit views read `n_tokens` and the packed log-probs
(audit_views_v4.sql); the downgrade converts back and restores audit_views_v3.sql.

A finished segment's payload may move to the payload store (`staleflow_db/payload_store.py`):
`payload_objects` (one row per object: URL, size, SHA-256) and `segments.payload_object` /
`payload_offset`; CHECK `placed`: a payload is in the row or in an object, never both or
neither. The segments' append-only trigger now allows exactly that one update (payload to
NULL, the object set, every other column unchanged); `ix_segments_resident` finds the payloads
still in the table. The downgrade is refused while a payload is in the store.

Revision ID: 0015
Revises: 0014
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

AUDIT_VIEWS = "audit_views_v3.sql"  # frozen: the audit views before this migration
AUDIT_VIEWS_AFTER = "audit_views_v4.sql"  # frozen: the audit views as this migration applies them

# Every view (all in audit.sql) reads segments or a view that does: dropped, then applied again.
VIEWS = (
    "staleness_violations, trained_lineage, turn_violations, lineage_violations, staleness_violations_v2,"
    " trained_samples, dropped_samples"
)

# Conversion helpers, dropped again after use. int4send/float4send give big-endian bytes.
PACK = r"""
CREATE FUNCTION staleflow_m15_le(b bytea) RETURNS bytea LANGUAGE sql IMMUTABLE STRICT AS $$
SELECT substring(b FROM 4 FOR 1) || substring(b FROM 3 FOR 1) || substring(b FROM 2 FOR 1) || substring(b FROM 1 FOR 1) $$;
CREATE FUNCTION staleflow_m15_pack_int4(a int[]) RETURNS bytea LANGUAGE sql IMMUTABLE STRICT AS $$
SELECT coalesce(string_agg(staleflow_m15_le(int4send(v)), ''::bytea ORDER BY o), ''::bytea)
FROM unnest(a) WITH ORDINALITY AS z(v, o) $$;
CREATE FUNCTION staleflow_m15_pack_float4(a real[]) RETURNS bytea LANGUAGE sql IMMUTABLE STRICT AS $$
SELECT coalesce(string_agg(staleflow_m15_le(float4send(v)), ''::bytea ORDER BY o), ''::bytea)
FROM unnest(a) WITH ORDINALITY AS z(v, o) $$;
"""
DROP_PACK = """
DROP FUNCTION staleflow_m15_pack_int4(int[]); DROP FUNCTION staleflow_m15_pack_float4(real[]);
DROP FUNCTION staleflow_m15_le(bytea);
"""

# The reverse: the bytes as an unsigned 32-bit word, then int4 (two's complement) or the IEEE
# float32 it encodes (exact in float8 arithmetic, then exactly representable as real).
UNPACK = r"""
CREATE FUNCTION staleflow_m15_word(b bytea, i int) RETURNS bigint LANGUAGE sql IMMUTABLE STRICT AS $$
SELECT get_byte(b, i)::bigint + get_byte(b, i + 1)::bigint * 256 + get_byte(b, i + 2)::bigint * 65536
     + get_byte(b, i + 3)::bigint * 16777216 $$;
CREATE FUNCTION staleflow_m15_unpack_int4(b bytea) RETURNS int[] LANGUAGE sql IMMUTABLE STRICT AS $$
SELECT coalesce(array_agg((w - CASE WHEN w >= 2147483648 THEN 4294967296 ELSE 0 END)::int ORDER BY i), '{}')
FROM generate_series(0, octet_length(b) - 4, 4) AS i, LATERAL (SELECT staleflow_m15_word(b, i) AS w) x $$;
CREATE FUNCTION staleflow_m15_unpack_float4(b bytea) RETURNS real[] LANGUAGE sql IMMUTABLE STRICT AS $$
SELECT coalesce(array_agg(CASE
    WHEN e = 255 AND m <> 0 THEN 'NaN'::real
    WHEN e = 255 THEN CASE WHEN s = 1 THEN '-Infinity'::real ELSE 'Infinity'::real END
    WHEN e = 0 THEN ((1 - 2 * s)::float8 * m::float8 * power(2::float8, -149))::real
    ELSE ((1 - 2 * s)::float8 * (8388608 + m)::float8 * power(2::float8, e - 150))::real END ORDER BY i), '{}')
FROM generate_series(0, octet_length(b) - 4, 4) AS i,
LATERAL (SELECT staleflow_m15_word(b, i) AS w) x,
LATERAL (SELECT (x.w >> 31)::int AS s, ((x.w >> 23) & 255)::int AS e, x.w & 8388607 AS m) f $$;
"""
DROP_UNPACK = """
DROP FUNCTION staleflow_m15_unpack_int4(bytea); DROP FUNCTION staleflow_m15_unpack_float4(bytea);
DROP FUNCTION staleflow_m15_word(bytea, int);
"""


# Rows never change, except that a payload may move to the payload store once.
OFFLOAD_ONLY = r"""
CREATE FUNCTION staleflow_segments_offload_only() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    moved CONSTANT text[] := '{token_ids,logprobs,payload_object,payload_offset}';
BEGIN
    IF TG_OP = 'UPDATE' AND OLD.token_ids IS NOT NULL AND OLD.payload_object IS NULL
       AND NEW.token_ids IS NULL AND NEW.logprobs IS NULL AND NEW.payload_object IS NOT NULL
       AND to_jsonb(NEW) - moved = to_jsonb(OLD) - moved THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION '% is append-only (only a payload may move to the payload store)', TG_TABLE_NAME
        USING ERRCODE = 'restrict_violation';
END $$;
DROP TRIGGER segments_append_only ON segments;
CREATE TRIGGER segments_append_only BEFORE UPDATE OR DELETE ON segments
    FOR EACH ROW WHEN (pg_trigger_depth() = 0) EXECUTE FUNCTION staleflow_segments_offload_only();
"""
APPEND_ONLY = """
DROP TRIGGER segments_append_only ON segments;
CREATE TRIGGER segments_append_only BEFORE UPDATE OR DELETE ON segments
    FOR EACH ROW WHEN (pg_trigger_depth() = 0) EXECUTE FUNCTION staleflow_append_only();
DROP FUNCTION staleflow_segments_offload_only();
"""


def _store_upgrade() -> None:
    op.create_table(
        "payload_objects",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.BigInteger(), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_payload_objects_run_id"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_payload_objects")),
        sa.UniqueConstraint("url", name=op.f("uq_payload_objects_url")),
    )
    op.add_column("segments", sa.Column("payload_object", sa.BigInteger()))
    op.add_column("segments", sa.Column("payload_offset", sa.BigInteger()))
    op.create_foreign_key(op.f("fk_segments_payload_object"), "segments", "payload_objects", ["payload_object"], ["id"])
    op.alter_column("segments", "token_ids", nullable=True)
    op.alter_column("segments", "logprobs", nullable=True)
    op.create_check_constraint(
        op.f("ck_segments_placed"),
        "segments",
        "(token_ids IS NULL) = (payload_object IS NOT NULL) AND (logprobs IS NULL) = (token_ids IS NULL)"
        " AND (payload_offset IS NULL) = (payload_object IS NULL) AND coalesce(payload_offset, 0) >= 0",
    )
    op.create_index("ix_segments_resident", "segments", ["run_id"], postgresql_where=sa.text("token_ids IS NOT NULL"))
    op.execute(OFFLOAD_ONLY)


def _store_downgrade() -> None:
    op.alter_column("segments", "token_ids", nullable=False)  # refused while a payload is in the store
    op.alter_column("segments", "logprobs", nullable=False)
    op.execute(APPEND_ONLY)
    op.drop_index("ix_segments_resident", table_name="segments", postgresql_where=sa.text("token_ids IS NOT NULL"))
    op.drop_constraint(op.f("ck_segments_placed"), "segments", type_="check")
    op.drop_constraint(op.f("fk_segments_payload_object"), "segments", type_="foreignkey")
    op.drop_column("segments", "payload_offset")
    op.drop_column("segments", "payload_object")
    op.drop_table("payload_objects")


def _apply(frozen_views: str) -> None:
    from staleflow_db import queries

    for statement in queries.ddl_statements(frozen_views):
        op.execute(sa.text(statement))


def upgrade() -> None:
    op.execute(f"DROP VIEW {VIEWS}")
    op.execute("ALTER TABLE segments DROP CONSTRAINT ck_segments_aligned")
    # a generated column computes the counts in the table rewrite (no UPDATE: the rows are
    # append-only), then becomes a plain column
    op.execute("ALTER TABLE segments ADD COLUMN n_tokens integer GENERATED ALWAYS AS (cardinality(token_ids)) STORED")
    op.execute("ALTER TABLE segments ALTER COLUMN n_tokens DROP EXPRESSION")
    op.execute("ALTER TABLE segments ALTER COLUMN n_tokens SET NOT NULL")
    op.execute(PACK)
    op.execute(
        "ALTER TABLE segments ALTER COLUMN token_ids TYPE bytea USING staleflow_m15_pack_int4(token_ids),"
        " ALTER COLUMN logprobs TYPE bytea USING staleflow_m15_pack_float4(logprobs)"
    )
    op.execute(DROP_PACK)
    op.execute(
        "ALTER TABLE segments ADD CONSTRAINT ck_segments_aligned CHECK (n_tokens >= 0"
        " AND octet_length(token_ids) = 4 * n_tokens AND octet_length(logprobs) = 4 * n_tokens)"
    )
    _store_upgrade()
    _apply(AUDIT_VIEWS_AFTER)


def downgrade() -> None:
    _store_downgrade()
    op.execute(f"DROP VIEW {VIEWS}")
    op.execute("ALTER TABLE segments DROP CONSTRAINT ck_segments_aligned")
    op.execute(UNPACK)
    op.execute(
        "ALTER TABLE segments ALTER COLUMN token_ids TYPE integer[] USING staleflow_m15_unpack_int4(token_ids),"
        " ALTER COLUMN logprobs TYPE real[] USING staleflow_m15_unpack_float4(logprobs)"
    )
    op.execute(DROP_UNPACK)
    op.execute("ALTER TABLE segments DROP COLUMN n_tokens")
    op.execute(
        "ALTER TABLE segments ADD CONSTRAINT ck_segments_aligned CHECK (cardinality(token_ids) = cardinality(logprobs))"
    )
    _apply(AUDIT_VIEWS)
