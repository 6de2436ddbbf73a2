"""vLLM: its object (`engine`), its serving check (`serving`), its recipe section (`settings`), the offline engine
this toolkit drives (`offline`), `verify --engine vllm` (`verify`) and doctor's reading of an export (`doctor`)."""
