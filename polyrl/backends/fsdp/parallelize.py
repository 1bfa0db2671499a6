"""Parallelisms applied to a plain HF module, in torchtitan's order: activation
checkpointing, then FSDP2 (per decoder layer, then the root)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard


def decoder_layers(lm: nn.Module) -> list[nn.Module]:
    """The modules named in the model's `_no_split_modules` (its transformer blocks)."""
    names = set(getattr(lm, "_no_split_modules", None) or [])
    layers = [m for m in lm.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(lm).__name__} declares no _no_split_modules; cannot find its decoder layers to shard")
    return layers


def apply_ac(lm: nn.Module, context_fn=None) -> None:
    """Full activation checkpointing of each decoder layer (non-reentrant, so FSDP hooks
    and torch.compile see through it). context_fn: torch.utils.checkpoint's (the contexts of the forward and of its
    recomputation in the backward)."""
    kwargs = {"use_reentrant": False, **({"context_fn": context_fn} if context_fn is not None else {})}
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if hasattr(lm, "config"):
        lm.config.use_cache = False


def apply_compile(lm: nn.Module) -> None:
    """Compile each decoder layer on its own (the layers are identical, so one compiled graph
    is reused; dynamic shapes because packed lengths change every micro-batch)."""
    for layer in decoder_layers(lm):
        layer.compile(dynamic=True)


def apply_fsdp(root: nn.Module, lm: nn.Module, mesh, *, param_dtype: torch.dtype, cpu_offload: bool,
               reshard_after_forward: bool = True) -> nn.Module:
    kw: dict = {"mesh": mesh}
    if param_dtype != torch.float32:
        # compute in low precision, keep FP32 master weights and reduce gradients in FP32; on one rank nothing is
        # reduced: the BF16 gradient goes through FSDP's copy as is and is cast once into the FP32 sharded grad (the
        # same numbers; about the same bytes moved, not measured apart from the log-prob change it landed with)
        reduce = torch.float32 if mesh.size() > 1 else param_dtype
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce)
    if cpu_offload:
        # pinned memory needs a CUDA driver; on CPU-only machines plain pageable memory
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for layer in decoder_layers(lm):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kw)
    fully_shard(root, **kw)
    return root
