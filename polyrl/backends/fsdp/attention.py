"""Varlen (packed, no padding) causal attention for HF models on GPU.

Registered under the name "varlen" through transformers' public AttentionInterface, with an
AttentionMaskInterface entry that builds no mask: sequence boundaries travel as cu_seqlens
kwargs through the model's forward into `polyrl.backends.varlen.causal` (PyTorch's FlashAttention varlen
kernel), so packed micro-batches cost no [L, L] mask and no padding.
"""

from __future__ import annotations

import torch

from polyrl.backends import varlen

NAME = "varlen"


def available() -> bool:
    return varlen.available()


def _varlen_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    if kwargs.get("is_causal") is False:
        # a vision tower's bidirectional attention over one image (Qwen-VL calls it once per image or window; the
        # text's cu_seqlens ride along in kwargs and are not this call's)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=scaling,
                                                               enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2).contiguous(), None
    cu = kwargs["cu_seq_lens_q"]
    max_len = kwargs["max_length_q"]
    # HF hands [1, heads, L, head_dim]; the kernel wants [L, heads, head_dim]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    return varlen.causal(q, k, v, cu, cu, max_len, max_len, scale=scaling)[None], None


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
