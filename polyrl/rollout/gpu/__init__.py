"""The embedded engine's GPU path (paged KV cache, continuous batching, CUDA graphs).
`polyrl.rollout.embedded.make_embedded_engine` picks it on CUDA for supported architectures."""

from polyrl.rollout.gpu.engine import GPUEngine, unsupported_reason

__all__ = ["GPUEngine", "unsupported_reason"]
