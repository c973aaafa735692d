"""Verifiable tasks: prompt generators and verifiers (reward functions)."""
