"""speculators_train: train draft models for speculative decoding and ship them to vLLM and SGLang."""

__version__ = "0.1.0"
