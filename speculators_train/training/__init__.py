"""Training: the loop every family shares (one training step), its data sources, checkpoints and ZeRO state."""
