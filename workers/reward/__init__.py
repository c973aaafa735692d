"""Reward: the worker that scores finished samples with rule-based verifiers."""
