"""MXFP4 expert weights (GPT-OSS checkpoints) dequantized to a float dtype on load.

Layout, as OpenAI's checkpoints store `mlp.experts.{gate_up,down}_proj`:
    {name}_blocks [E, R, G, 16] uint8: two FP4 (E2M1) codes per byte, low nibble first, 32 values per group
    {name}_scales [E, R, G]     uint8: one shared power-of-two exponent per group, biased by 127
value = FP4_VALUES[code] * 2 ** (scale - 127); the dequantized [E, R, G * 32] is transposed to HF's
parameter layout [E, G * 32, R] (GPT-OSS computes x @ W). Same arithmetic as transformers'
`integrations.mxfp4.convert_moe_packed_tensors`, in pure torch (no kernels), so it runs on CPU.
"""

from __future__ import annotations

import torch
from torch import Tensor

# E2M1 code -> value: sign bit 3, then exponent / mantissa
FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """blocks [..., R, G, B] uint8, scales [..., R, G] uint8 -> [..., G * B * 2, R] in `dtype` (exact: every FP4
    value times a power of two is representable in BF16 for the exponents checkpoints use)."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
                         "(blocks must be scales' shape plus a trailing byte dimension)")
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    b = blocks.to(torch.uint8)
    out = torch.empty(*b.shape[:-1], b.shape[-1] * 2, dtype=dtype, device=b.device)
    out[..., 0::2] = lut[(b & 0x0F).long()]
    out[..., 1::2] = lut[(b >> 4).long()]
    out = torch.ldexp(out, (scales.to(torch.int32) - 127)[..., None]).to(dtype)
    return out.flatten(-2).transpose(-1, -2).contiguous()
