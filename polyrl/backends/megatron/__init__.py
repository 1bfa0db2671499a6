"""Megatron-core training backend.

`bridge` converts weights between Hugging Face and megatron-core (local spec) layouts with plain
torch + safetensors; it never imports megatron, so conversion and its tests run anywhere. `thd`
(packed THD micro-batches, varlen / context-parallel attention, vocab-parallel log-probs) is plain
torch too and is tested on CPU. `model` (layer spec, GPTModel chunks, DDP / Megatron-FSDP,
optimizer) and `backend` (the TrainBackend) import megatron-core only when a backend is built.
"""
