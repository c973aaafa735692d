"""Training: the trainer loop (torch and sim), GRPO/DAPO losses, and the parameter server."""
