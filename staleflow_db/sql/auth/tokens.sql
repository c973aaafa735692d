-- API bearer tokens (staleflow_db/tokens.py, used by api/auth.py): stored as sha256 hashes
-- with a role and an optional run.

-- name: token_run_exists
SELECT 1 FROM runs WHERE id = :r

-- name: token_create
INSERT INTO api_tokens (token_hash, role, run_id, name) VALUES (:h, CAST(:role AS token_role), :run, :name)
RETURNING id, role, run_id, name, created_at, revoked_at

-- name: token_list
-- Every token, or only those of :run when it is not null.
SELECT id, role, run_id, name, created_at, revoked_at FROM api_tokens
WHERE (CAST(:run AS bigint) IS NULL OR run_id = :run) ORDER BY id

-- name: token_lock
SELECT run_id, revoked_at FROM api_tokens WHERE id = :i FOR UPDATE

-- name: token_revoke
UPDATE api_tokens SET revoked_at = now() WHERE id = :i

-- name: token_valid
SELECT 1 FROM api_tokens WHERE token_hash = :h AND revoked_at IS NULL

-- name: token_principal
-- The token's id, role and run; none for an unknown or revoked token.
SELECT id, role, run_id FROM api_tokens WHERE token_hash = :h AND revoked_at IS NULL
