"""Varlen (packed, no padding) causal attention for HF models on GPU.

Registered under the name "varlen" through transformers' public AttentionInterface, with an
AttentionMaskInterface entry that builds no mask: sequence boundaries travel as cu_seqlens
kwargs through the model's forward into `torch.nn.attention.varlen.varlen_attn` (a FlashAttention
kernel inside PyTorch), so packed micro-batches cost no [L, L] mask and no padding.
"""

from __future__ import annotations

import torch

from polyrl.backends.gqa import repeat_kv_heads

NAME = "varlen"


def available() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def _varlen_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    from torch.nn.attention.varlen import varlen_attn

    cu = kwargs["cu_seq_lens_q"]
    max_len = kwargs["max_length_q"]
    # HF hands [1, heads, L, head_dim]; the kernel wants [L, heads, head_dim]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    if k.shape[1] != q.shape[1]:  # GQA: expand kv heads (the kernel's enable_gqa needs equal head counts on some builds)
        k, v = repeat_kv_heads(k, q.shape[1]), repeat_kv_heads(v, q.shape[1])
    out = varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, max_len, max_len, scale=scaling,
                      window_size=(-1, 0))  # (-1, 0): unlimited left context, none to the right = causal
    return out[None], None


def _no_mask(*args, **kwargs):
    return None


def register() -> str:
    from transformers import AttentionInterface, AttentionMaskInterface
    AttentionInterface.register(NAME, _varlen_forward)
    AttentionMaskInterface.register(NAME, _no_mask)
    return NAME


def resolve(requested: str, device_type: str, dtype: torch.dtype = torch.bfloat16) -> str:
    """`auto` picks varlen on CUDA when PyTorch has it (half precision: flash kernels), sdpa
    (with a block-diagonal mask) otherwise."""
    if requested == "auto":
        half = dtype in (torch.bfloat16, torch.float16)
        requested = NAME if device_type == "cuda" and half and available() else "sdpa"
    if requested == NAME:
        if not available():
            raise ValueError("--attn-implementation varlen needs CUDA and torch.nn.attention.varlen (PyTorch >= 2.10)")
        register()
    return requested
