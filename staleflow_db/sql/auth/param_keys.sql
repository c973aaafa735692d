-- Each run's parameter-server secret (staleflow_db/param_keys.py): random, created on first
-- use; the API derives the keys it hands out from it (api/auth.py).

-- name: param_key_create
-- Nothing for an unknown run or one that has its secret already.
INSERT INTO param_keys (run_id, secret) SELECT id, :s FROM runs WHERE id = :r
ON CONFLICT (run_id) DO NOTHING

-- name: param_key_get
SELECT secret FROM param_keys WHERE run_id = :r
