"""Model definitions shared by the rollout engines and the trainer."""
