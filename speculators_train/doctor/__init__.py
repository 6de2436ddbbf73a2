"""`speculators-train doctor`: why a draft accepts less when served than it did in training."""
