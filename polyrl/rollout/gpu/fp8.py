"""FP8 linears of the GPU engine (--rollout-quantization fp8): what is pure of them (which matrices, their scale grids,
the kernel's launch settings), so the CPU tests check it and `triton_ops.fp8_linear` only launches.

The engine keeps each decoder linear (fused q|k|v, o, fused gate|up, down) as float8_e4m3fn [N, K] with a float32
scale per 128x128 block, the layout of the weight stream (polyrl.weight_sync.quantize), inside its one flat buffer.
A fused matrix's HF parts (q, k, v) are quantized separately by the trainer, so its scale grid is the parts' grids
stacked; that is the grid of the fused matrix itself (row block n // 128) when every part but the last has a multiple
of 128 rows. Otherwise (small test models) the engine keeps one scale row per weight row (`row_div` 1), expanded
from the parts' grids on load, and the kernel reads scale row n instead of n // 128.
"""

from __future__ import annotations

import torch

from polyrl.weight_sync.quantize import BLOCK, dequantize_fp8_block

FP8_KEYS = ("qkv_w", "o_w", "gu_w", "down_w")  # per-layer matrices held in FP8; embeddings, norms, LM head, routers
# and (for now) MoE experts stay in the model dtype
SCALE = ".s"  # layout key of a matrix's scales: f"{i}.qkv_w.s"


def row_div(parts: list[int]) -> int:
    """128 when the stacked parts' block grids are the fused matrix's grid (every part but the last a whole number of
    128-row blocks), else 1 (one scale row per weight row)."""
    return BLOCK[0] if all(p % BLOCK[0] == 0 for p in parts[:-1]) else 1


def scale_grid(parts: list[int], k: int) -> tuple[int, int]:
    """Shape of the engine's scale tensor for a fused matrix of `parts` rows and k columns."""
    n, kb = sum(parts), -(-k // BLOCK[1])
    return (-(-n // BLOCK[0]), kb) if row_div(parts) == BLOCK[0] else (n, kb)


def part_scale_rows(parts: list[int], j: int) -> tuple[int, int]:
    """Rows [lo, hi) of the engine's scale tensor that hold part j's scales."""
    r0 = sum(parts[:j])
    r1 = r0 + parts[j]
    if row_div(parts) == BLOCK[0]:
        return r0 // BLOCK[0], -(-r1 // BLOCK[0])
    return r0, r1


def dequantize(w: torch.Tensor, s: torch.Tensor, rdiv: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The engine's FP8 matrix as `dtype` (q * its block's scale), from either scale layout."""
    if rdiv == BLOCK[0]:
        return dequantize_fp8_block(w, s, BLOCK, dtype)
    k = w.shape[1]
    return (w.float() * s.float().repeat_interleave(BLOCK[1], 1)[:, :k]).to(dtype)


def kernel_config(M: int, N: int, K: int, sms: int) -> dict:
    """Launch settings of the weight-only FP8 kernel for x [M, K] @ w[N, K]^T. Decode (small M) is bound by reading
    the weight once, so the output tiles are few and K is split until about two programs per SM stream it; the
    k-tile (BK) divides 128, so each tile of a weight row has one scale."""
    if M <= 128:
        bm = max(16, 1 << (M - 1).bit_length())
        cfg = dict(BM=bm, BN=64, BK=128, num_warps=4, num_stages=4 if bm <= 64 else 3)
    else:
        cfg = dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=3)
    tiles = -(-M // cfg["BM"]) * -(-N // cfg["BN"])
    k_iters = -(-K // cfg["BK"])
    split = 1
    if M <= 512 and tiles < 2 * sms:
        split = max(1, min(-(-2 * sms // tiles), k_iters // 4, 16))
    k_per = -(-k_iters // split) * cfg["BK"]
    cfg["split"] = -(-K // k_per)
    cfg["k_per_split"] = k_per
    return cfg
