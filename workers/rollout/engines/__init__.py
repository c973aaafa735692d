"""Rollout engines: the shared interface (base) and its implementations."""
