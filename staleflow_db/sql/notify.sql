-- Wake-ups between processes (staleflow_db/notify.py): channel `staleflow`.

-- name: notify
-- Each payload NOTIFYed on channel :ch, in one statement.
SELECT pg_notify(:ch, p) FROM unnest(CAST(:ps AS text[])) AS p

-- name: listen
-- The API's listening connection (api/notify.py); the channel is notify.CHANNEL.
LISTEN staleflow

-- name: listen_alive
-- A probe of the listening connection between waits: a dead one raises here.
SELECT 1
