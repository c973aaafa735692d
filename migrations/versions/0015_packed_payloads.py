"""Packed segment payloads: `segments.token_ids` and `segments.logprobs` become `bytea`
(little-endian int32 / float32, 4 bytes per token: `staleflow_db/payloads.py`) with the count
in `segments.n_tokens`; CHECK `aligned` is now both 4 × n_tokens bytes. Existing rows are
converted in place (one table rewrite each way). The audit views read `n_tokens` and the packed
log-probs (audit_views_v4.sql); the downgrade converts back and restores audit_views_v3.sql.

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
    _apply(AUDIT_VIEWS_AFTER)


def downgrade() -> None:
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
