"""MTP heads: one decoder layer of the target's own class over its last state and the next token."""
