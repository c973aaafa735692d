-- Group commit (staleflow_db/group_commit.py): many callers' writes in one transaction.

-- name: group_commit_durable
-- A group with a durable item commits synchronously even if a heartbeat in it asked for
-- `synchronous_commit = off` (SET LOCAL lasts until the transaction ends): back to the
-- session's own setting.
SET LOCAL synchronous_commit TO DEFAULT
