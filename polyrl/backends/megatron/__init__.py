"""Megatron-core training backend.

`bridge` converts weights between Hugging Face and megatron-core (local spec) layouts with plain
torch + safetensors; it never imports megatron, so conversion and its tests run anywhere. The
modules that build and train megatron models import megatron-core themselves, lazily.
"""
