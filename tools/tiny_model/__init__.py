"""The embedded default model: its corpus, its torch definition, training, GGUF export and verification."""
