"""Built-in synthetic tasks: tiny tokenizers, model configs and data, so the whole system
runs on a CPU with no download."""
