"""Rollout: the worker that drives an inference engine behind the API, and the engines."""
