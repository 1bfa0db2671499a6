"""Megatron-core training backend.

`bridge` converts weights between Hugging Face and megatron-core (local spec) layouts with plain
torch + safetensors; it never imports megatron, so conversion and its tests run anywhere. `thd`
(packed THD micro-batches, varlen / context-parallel attention, vocab-parallel log-probs) is plain
torch too and is tested on CPU. `hf_wrap` runs a model's own HF token mixers (Qwen3-Next's gated
DeltaNet and gated attention) inside megatron's layers; it imports megatron-core only inside its
wrapper's methods. `ddp` (the DistributedDataParallelConfig arguments, --override-ddp-config) is plain
Python too. `model` (layer spec, GPTModel chunks, DDP / Megatron-FSDP,
optimizer) and `backend` (the TrainBackend) import megatron-core only when a backend is built.
"""
