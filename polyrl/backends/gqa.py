"""Grouped-query attention helper shared by the trainers' varlen attention (FSDP, Megatron) and the GPU engine's
prefill."""

from __future__ import annotations

import torch


def repeat_kv_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """x [T, hkv, d] -> [T, heads, d], each kv head repeated heads // hkv times in place (= repeat_interleave on dim
    1). An expand + reshape: repeat_interleave(int) on CUDA reads its output size back from the device, a host sync
    in every layer of every forward."""
    T, hkv, d = x.shape
    return x[:, :, None].expand(T, hkv, heads // hkv, d).reshape(T, heads, d)
