"""Megatron-core train backend (GPU only). megatron-core is imported here, lazily."""

from __future__ import annotations

import sys

INSTALL_HINT = "pip install -e .[megatron]  (megatron-core >= 0.19, Python >= 3.12, a CUDA GPU)"


def require_megatron() -> None:
    """Exit early with what is missing: megatron-core, Python >= 3.12 or CUDA."""
    import torch

    problems = []
    if sys.version_info < (3, 12):
        problems.append(f"Python >= 3.12 (this is {sys.version.split()[0]})")
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        problems.append("the megatron-core package")
    if not torch.cuda.is_available():
        problems.append("a CUDA GPU (megatron-core's parallel state needs one)")
    if problems:
        raise ImportError("--train-backend megatron needs " + ", ".join(problems) + f"; install with: {INSTALL_HINT}")


class MegatronBackend:
    def __init__(self, *args, **kwargs):
        require_megatron()
        raise NotImplementedError("the megatron-core train backend is not built yet (see the Megatron issue)")
