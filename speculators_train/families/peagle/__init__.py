"""P-EAGLE: parallel drafting, K draft tokens from one forward of an EAGLE-3-shaped draft."""
