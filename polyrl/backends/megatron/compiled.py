"""--compile on the Megatron backend: torch.compile of the pieces of megatron-core's local layer that polyrl owns, the
RMSNorms (model.HFRMSNorm: input, pre-MLP, q/k, final, post and MTP norms) and the RoPE of q and k in the core
attention (model.VarlenCoreAttention). Eager, a norm is about seven kernels forward and ten backward over FP32 copies
of the activations, and autograd keeps an FP32 copy of its input; compiled, it is one fused kernel each way (and RoPE
likewise, in place of seven).

Why these pieces and not each TransformerLayer whole (as the FSDP backend compiles each HF decoder layer): megatron-core
0.19.2's layer forward breaks dynamo's graph several times in every layer (its nvtx ranges, which dynamo skips, its
activation-offloading context manager, the resume functions of its custom-autograd linears), so a compiled layer runs
as fragments that fused nothing measurable (bench/RESULTS.md, megatron-vs-fsdp-8k). The GEMMs, the attention kernel
and megatron's fused SwiGLU need no compiler.

Only the token dimension is dynamic (each packed micro-batch has its own length); hidden and head sizes stay static.
Pure torch: tested on CPU (tests/backends/megatron/test_compiled_cpu.py).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from polyrl.backends.megatron import thd


def rms_norm(x: Tensor, weight: Tensor, eps: float, zero_centered: bool) -> Tensor:
    """HF's RMSNorm arithmetic: FP32 statistics, cast to x's dtype, then the weight; zero_centered (Qwen3-Next):
    x_norm * (1 + w) in FP32, then the cast."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


def rope_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """thd.apply_rope of q [T, hq, d] and k [T, hkv, d] with the tables cos / sin [T, 1, r]."""
    return thd.apply_rope(q, cos, sin), thd.apply_rope(k, cos, sin)


@functools.cache
def _compiled(fn):
    return torch.compile(fn)  # dynamic=None: shapes static unless marked (below) or seen to change


def _tokens_dynamic(*tensors: Tensor) -> None:
    """Compile for any token count at once (dim 0), not once per micro-batch length. A dim of size 1 cannot be marked
    (dynamo specialises sizes 0 and 1): such a call gets its own static graph."""
    for t in tensors:
        if t.shape[0] > 1:
            torch._dynamo.mark_dynamic(t, 0)


def compiled_rms_norm(x: Tensor, weight: Tensor, eps: float, zero_centered: bool) -> Tensor:
    # as rows [N, H]: the hidden states [T, 1, H] reach the norms with either stride on their size-1 dim, and the q/k
    # norms see [T, 1, heads, d]; every such call then shares one graph per width
    rows = x.reshape(-1, x.shape[-1])
    _tokens_dynamic(rows)
    return _compiled(rms_norm)(rows, weight, eps, zero_centered).view(x.shape)


def compiled_rope_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    _tokens_dynamic(q, k, cos, sin)
    return _compiled(rope_qk)(q, k, cos, sin)
