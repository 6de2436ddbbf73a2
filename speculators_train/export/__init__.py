"""Draft formats engines read: the speculators/vLLM layout (and, later, SGLang/EAGLE), written and read back."""
