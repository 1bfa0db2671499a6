"""The keyword arguments of megatron's DistributedDataParallelConfig from the Megatron flags: the defaults of each
mode (DDP, Megatron-FSDP) and --override-ddp-config's typed key=value overrides. Plain Python: the field table is
passed in (model.py passes the real dataclass's), so this runs and is tested without megatron-core."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

FSDP_DEFAULTS = dict(  # verl's Megatron-FSDP defaults; --override-ddp-config changes any of them
    use_megatron_fsdp=True, use_distributed_optimizer=True, data_parallel_sharding_strategy="optim_grads_params",
    overlap_grad_reduce=True, overlap_param_gather=True, check_for_nan_in_grad=True, grad_reduce_in_fp32=True)
INT_FIELDS = ("bucket_size", "num_buckets", "suggested_communication_unit_size")  # Optional[int], default None


def parse_overrides(items: list[str], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """`key=value` strings -> values typed by each field's default (`defaults`: field name -> default)."""
    out: dict[str, Any] = {}
    for item in items:
        key, _, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if key not in defaults:
            raise ValueError(f"--override-ddp-config {item!r}: DistributedDataParallelConfig has no field {key!r}")
        default = defaults[key]
        low = raw.strip().lower()
        if isinstance(default, bool):
            if low not in ("true", "false", "1", "0"):
                raise ValueError(f"--override-ddp-config {item!r}: expected true/false")
            out[key] = low in ("true", "1")
        elif low in ("none", "null"):
            out[key] = None
        elif isinstance(default, int) or key in INT_FIELDS:
            out[key] = _typed(item, raw, int, "an integer")
        elif isinstance(default, float):
            out[key] = _typed(item, raw, float, "a number")
        elif isinstance(default, torch.dtype) or "dtype" in key:
            dtype = getattr(torch, raw.strip().replace("torch.", ""), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"--override-ddp-config {item!r}: expected a torch dtype (float32, bfloat16, ...)")
            out[key] = dtype
        else:
            out[key] = raw.strip()
    return out


def _typed(item: str, raw: str, kind, what: str):
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"--override-ddp-config {item!r}: expected {what}") from None


def ddp_kwargs(mg, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """DistributedDataParallelConfig(**this) for the MegatronConfig `mg`: the mode's settings, then the overrides."""
    if mg.use_megatron_fsdp:
        kw = dict(FSDP_DEFAULTS)
    else:
        kw = dict(use_distributed_optimizer=mg.use_distributed_optimizer, grad_reduce_in_fp32=True,
                  overlap_grad_reduce=False)
    kw.update(parse_overrides(mg.override_ddp_config, defaults))
    if kw.get("bucket_size") is not None and not kw.get("overlap_grad_reduce"):
        # megatron's DDP drops bucket_size without overlap_grad_reduce (one bucket): say so rather than ignore it
        raise ValueError("--override-ddp-config bucket_size=...: megatron splits gradient buckets only with "
                         "overlap_grad_reduce=true; add --override-ddp-config overlap_grad_reduce=true")
    return kw
