"""Training: the loop every family shares (one training step), its batch streams, checkpoints and strategies."""
