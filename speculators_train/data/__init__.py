"""Chat data: read sources, normalise roles, mix, split by record id, render with the chat template."""
