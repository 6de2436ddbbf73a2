"""llama.cpp: its object (`engine`), its serving check (`serving`), its recipe section (`settings`), its programs
built from the llama-cpp-python sdist (`build`), its GGUF converter (`converter`), llama-server with the client that
decodes through it (`server`), `verify --engine llama.cpp` (`verify`) and doctor's reading of a GGUF (`doctor`)."""
