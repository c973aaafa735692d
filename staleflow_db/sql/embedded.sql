-- The embedded server's set-up (staleflow_db/embedded.py), run on its `postgres` database.
-- CREATE DATABASE takes no parameters: embedded.py composes it with psycopg's sql.Identifier.

-- name: database_exists
SELECT 1 FROM pg_database WHERE datname = :name
