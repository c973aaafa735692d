-- Request-id idempotency (staleflow_db/idempotency.py).

-- name: idempotency_lookup
-- The key's lock and its stored outcome in one round trip (function_idempotency_lookup).
SELECT operation, response FROM staleflow_idempotency_lookup(:k)

-- name: idempotency_store
INSERT INTO idempotency (request_id, operation, response) VALUES (:r, :o, CAST(:resp AS jsonb))
ON CONFLICT (request_id) DO NOTHING

-- name: idempotency_prune
DELETE FROM idempotency WHERE request_id IN (SELECT request_id FROM idempotency
WHERE created_at < now() - make_interval(secs => :ttl) LIMIT :n)

-- name: function_idempotency_lookup
-- staleflow_idempotency_lookup(key): a request id's transaction advisory lock and its stored
-- outcome. Under READ COMMITTED the lookup takes its own snapshot after the lock is granted,
-- so a concurrent duplicate that waited sees the first one's committed outcome.
CREATE OR REPLACE FUNCTION staleflow_idempotency_lookup(p_key text) RETURNS TABLE (operation text, response jsonb)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_key, 7));
    RETURN QUERY SELECT i.operation, i.response FROM idempotency i WHERE i.request_id = p_key;
END
$$
