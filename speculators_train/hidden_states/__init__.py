"""Hidden-state generation: run the target over rendered chat data and keep the states drafts train on."""
