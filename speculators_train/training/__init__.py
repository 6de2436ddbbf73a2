"""Training: the trainer loop, EAGLE-3 training-time test, losses, checkpoints."""
