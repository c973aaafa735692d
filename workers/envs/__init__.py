"""Environments for multi-turn rollouts (docs/integration.md, "Your environment")."""
