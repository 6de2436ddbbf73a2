"""llama.cpp run for real: its programs built from the llama-cpp-python sdist (`build`), its GGUF converter
(`converter`), and llama-server with the client that decodes through it (`server`)."""
