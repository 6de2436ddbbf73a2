"""Medusa-1: heads of residual blocks and a vocab projection over the target's last hidden state."""
