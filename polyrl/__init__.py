"""polyrl: RL post-training for LLMs with pluggable training backends and rollout engines.

Importing polyrl imports only torch, transformers and the standard library; heavy optional
dependencies (megatron-core, ray, sglang) are loaded by the modules that need them.
"""

__version__ = "0.1.0"
