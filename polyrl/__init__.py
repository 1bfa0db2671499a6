"""polyrl: RL post-training for LLMs with pluggable training backends and rollout engines.

Importing polyrl imports only torch, transformers and the standard library; heavy optional
dependencies (megatron-core, ray, sglang) are loaded by the modules that need them.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    """polyrl.train (polyrl/api.py), imported on first use: `import polyrl` stays free of torch."""
    if name == "train":
        from polyrl.api import train
        return train
    raise AttributeError(f"module 'polyrl' has no attribute {name!r}")
