"""Draft formats engines read (speculators/vLLM, SGLang/EAGLE): written by `export`, read back for verify/train."""
