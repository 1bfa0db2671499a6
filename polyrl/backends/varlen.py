"""Causal attention over packed sequences through `torch.nn.attention.varlen.varlen_attn` (a FlashAttention kernel
inside PyTorch): one call for a whole packed batch, no padding, no [L, L] mask. One wrapper for its users (FSDP's HF
attention, Megatron's THD core attention, the GPU engine's prefill), across the API's versions:

- causality is `is_causal=True` where the function takes it, else `window_size=(-1, 0)` (unlimited left context,
  none to the right) as in PyTorch 2.10 / 2.11;
- grouped-query attention: the kernel shares each kv head among its query heads itself (`enable_gqa=True` where the
  function takes it, PyTorch >= 2.12; PyTorch 2.11's wrapper passes fewer kv heads straight to the same FlashAttention
  kernel), else the kv heads are repeated (an expand + reshape, no host sync). Sharing saved the repeat's copies:
  0.68 -> 0.46 ms for the forward of a 1.5B-shaped attention (12 query, 2 kv heads) over 37.9k tokens on an H200,
  with the same output bits and the same dk / dv (bench/history/2026-11.md#true-on-policy-kv-heads-2026-11-29).
"""

from __future__ import annotations

import functools

import torch

from polyrl.backends.gqa import repeat_kv_heads


@functools.cache
def _fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _params() -> frozenset[str]:
    import inspect

    fn = _fn()
    return frozenset(inspect.signature(fn).parameters) if fn is not None else frozenset()


def available() -> bool:
    """PyTorch has varlen_attn and a CUDA device to run it on."""
    return _fn() is not None and torch.cuda.is_available()


def usable(device, dtype: torch.dtype) -> bool:
    """varlen_attn can take tensors of this device and dtype (the flash kernels: CUDA, BF16 / FP16)."""
    return torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16) and _fn() is not None


# the first PyTorch whose varlen_attn (without an enable_gqa flag) was run with fewer kv heads than query heads
NATIVE_GQA_FROM = "2.11"


@functools.cache
def shares_kv_heads() -> bool:
    """varlen_attn takes fewer kv heads than query heads itself (`enable_gqa`, or PyTorch 2.11's pass-through)."""
    return "enable_gqa" in _params() or (_fn() is not None and torch.__version__ >= NATIVE_GQA_FROM)


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
           max_k: int, scale: float | None = None) -> torch.Tensor:
    """q [Tq, hq, d], k / v [Tk, hkv, d] (hq a multiple of hkv), cu_q / cu_k int32 [S + 1] sequence boundaries ->
    [Tq, hq, d]. Segment s's queries attend to its keys causally, aligned at the bottom right (its last query sees its
    last key)."""
    fn = _fn()
    if fn is None:
        raise RuntimeError("varlen attention needs torch.nn.attention.varlen (PyTorch >= 2.10)")
    kw = {"is_causal": True} if "is_causal" in _params() else {"window_size": (-1, 0)}
    if k.shape[1] != q.shape[1]:
        # with one query row per sequence and is_causal, FlashAttention drops the mask and folds a kv head's query
        # heads into the rows of one program, another kernel specialisation: equal head counts keep such packs off it
        if shares_kv_heads() and max_q > 1:
            if "enable_gqa" in _params():
                kw["enable_gqa"] = True
        else:
            k, v = repeat_kv_heads(k, q.shape[1]), repeat_kv_heads(v, q.shape[1])
    return fn(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, max_k, scale=scale, **kw)
