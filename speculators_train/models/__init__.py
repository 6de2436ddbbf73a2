"""Draft architectures, one module each."""
