"""FP8 linears of the GPU engine (--rollout-quantization fp8): what is pure of them (which matrices, their scale grids,
the kernel's launch settings), so the CPU tests check it and `triton_ops.fp8_linear` only launches.

The engine keeps each decoder linear (fused q|k|v, o, fused gate|up, down) as float8_e4m3fn [N, K] with a float32
scale per 128x128 block, the layout of the weight stream (polyrl.weight_sync.quantize), inside its one flat buffer.
A fused matrix's HF parts (q, k, v) are quantized separately by the trainer, so its scale grid is the parts' grids
stacked; that is the grid of the fused matrix itself (row block n // 128) when every part but the last has a multiple
of 128 rows. Otherwise (small test models) the engine keeps one scale row per weight row (`row_div` 1), expanded
from the parts' grids on load, and the kernel reads scale row n instead of n // 128.

MoE experts are held the same way, stacked: gate|up [E, 2I, H] and down [E, H, I] as float8_e4m3fn with scales
[E, *scale_grid] (each expert's gate and up quantized on their own, like a fused matrix's parts), run by the grouped
FP8 kernel (triton_ops.fp8_grouped_linear) or, for long prefills, dequantized into a transient copy (EXPERTS_DEQUANT_MIN_ROWS).
"""

from __future__ import annotations

import torch

from polyrl.weight_sync.quantize import BLOCK, dequantize_fp8_block

FP8_KEYS = ("qkv_w", "o_w", "gu_w", "down_w", "egu", "edown")  # per-layer matrices (and stacked MoE experts) held in
# FP8; embeddings, norms, the LM head and routers stay in the model dtype
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
    """The engine's FP8 matrix as `dtype` (q * its block's scale), from either scale layout; w [..., N, K] with
    scales [..., rows, ceil(K / 128)] (stacked experts: one grid per expert)."""
    if rdiv == BLOCK[0] and w.dim() == 2:
        return dequantize_fp8_block(w, s, BLOCK, dtype)
    n, k = w.shape[-2:]
    full = s.float().repeat_interleave(rdiv, -2)[..., :n, :].repeat_interleave(BLOCK[1], -1)[..., :k]
    return (w.float() * full).to(dtype)


# How each size runs (bench/fp8_rollout.py --sweep, H100, 2026-11-27; per matrix of the Qwen2.5-1.5B / 7B layers):
# decode sizes take the Triton kernels, whose best tile at M = 64 was BM 64, BN 64, BK 128, 4 warps, 3 stages for all
# eight matrices and both modes (w8a8, one layer of 7B: 129 us with the best split per matrix, 131 us with
# auto_split, 185 us for cuBLAS BF16). Quantizing the activations inside the GEMM (quant_x) lost everywhere (162 us):
# each weight-row tile re-quantizes the same activations. Larger M is bound by the products: w8a8 from M = 129 takes
# cuBLAS's block-scaled FP8 GEMM (7B layer at M = 256: 193 us against 288 us for the best Triton tile and 212 us for
# BF16; at M = 8192: 4.42 ms against 4.93 ms), and w8a16 from M = 257 a transient BF16 copy of the weight for cuBLAS
# (its Triton tiles trail BF16 by 1.7x at M = 256: BF16 products, twice the FP8 ones' time).
# TILES: (max_M, BM, BN, BK, num_warps, num_stages, quant_x); BM 0: the tile covers all M tokens.
TILES = {
    "w8a16": ((128, 0, 64, 128, 4, 3, False), (256, 128, 128, 128, 8, 3, False)),
    "w8a8": ((128, 0, 64, 128, 4, 3, False), (512, 128, 64, 128, 4, 3, False)),
}
SCALED_MM_MIN_M = 129  # w8a8: from here cuBLAS's block-scaled FP8 GEMM, where the shape allows it
DEQUANT_MIN_M = {"w8a16": 257, "w8a8": 513}  # from here the dequantized weight and cuBLAS's BF16 GEMM
# K is split until about SPLIT_WAVES programs per SM stream the weight, never below SPLIT_MIN_K k-tiles per split
SPLIT_WAVES, SPLIT_MIN_K, SPLIT_MAX = 2, 4, 16


def scaled_mm_fits(N: int, K: int, row_div: int) -> bool:
    """Whether cuBLAS's block-scaled GEMM takes this matrix as the engine holds it: 128-row scale blocks, K and N
    multiples of 16, and a whole number of 4-float groups of scale columns (cuBLAS reads the 128x128 scales in 16-byte
    rows; the engine's grid is not padded, so Qwen2.5-1.5B's down_proj, 70 column blocks, is refused)."""
    return row_div == BLOCK[0] and K % 16 == 0 and N % 16 == 0 and -(-K // BLOCK[1]) % 4 == 0


def tile_config(M: int, N: int, K: int, BM: int, BN: int, BK: int, num_warps: int, num_stages: int, split: int = 1,
                quant_x: bool = False) -> dict:
    """A Triton launch of the FP8 kernels for x [M, K] @ w[N, K]^T; K cut into `split` runs of whole k-tiles (fewer if
    the last would be empty). BK divides 128, so each k-tile of a weight row has one scale."""
    if quant_x and BK != BLOCK[1]:
        raise ValueError(f"quant_x quantizes one 128-column activation group per k-tile: BK must be 128, not {BK}")
    k_iters = -(-K // BK)
    k_per = -(-k_iters // max(1, split)) * BK
    return dict(path="triton", BM=BM, BN=BN, BK=BK, num_warps=num_warps, num_stages=num_stages, quant_x=quant_x,
                split=-(-K // k_per), k_per_split=k_per)


def auto_split(M: int, N: int, K: int, BM: int, BN: int, BK: int, sms: int) -> int:
    tiles = -(-M // BM) * -(-N // BN)
    k_iters = -(-K // BK)
    if tiles >= SPLIT_WAVES * sms:
        return 1
    return max(1, min(-(-SPLIT_WAVES * sms // tiles), k_iters // SPLIT_MIN_K, SPLIT_MAX))


def kernel_config(M: int, N: int, K: int, sms: int, mode: str = "w8a16", row_div: int = BLOCK[0],
                  blockwise_mm: bool = False) -> dict:
    """How triton_ops.fp8_linear runs x [M, K] @ w[N, K]^T: a Triton tile at decode sizes, cuBLAS beyond (see TILES'
    comment). blockwise_mm: torch has cuBLAS's block-scaled FP8 GEMM on this GPU (triton_ops.blockwise_mm_available)."""
    if mode == "w8a8" and M >= SCALED_MM_MIN_M and blockwise_mm and scaled_mm_fits(N, K, row_div):
        return {"path": "scaled_mm"}
    if M >= DEQUANT_MIN_M[mode]:
        return {"path": "dequant"}
    for max_m, bm, bn, bk, warps, stages, quant_x in TILES[mode]:
        if M <= max_m:
            break
    bm = bm or max(16, 1 << (M - 1).bit_length())
    return tile_config(M, N, K, bm, bn, bk, warps, stages, auto_split(M, N, K, bm, bn, bk, sms), quant_x)


# FP8 MoE experts (triton_ops.fp8_grouped_linear): (token, expert) rows sorted by expert, one tile of BM rows never
# crossing experts. At decode an expert gets few rows (B k / E: 4 at B = 64 on Qwen3-30B-A3B), so BM follows the mean
# group size, from tl.dot's smallest 16 up to 64. Measured (bench/moe_rollout.py --experts-sweep, H100, 2026-11-27;
# one Qwen3-30B-A3B layer's experts under a CUDA graph): the kernel takes 332 us at 64 tokens against 545 us for the
# BF16 grouped GEMM, 1,423 us at 2,048 tokens against 1,676 us for the dequantized experts, and 2,672 us at 4,096
# against 2,066 us, where the products bound it; the qwen3-moe-1b shape crossed between 1,024 and 4,096 tokens. So
# from EXPERTS_DEQUANT_MIN_ROWS (token, expert) rows the layer's experts are dequantized into a transient copy for
# torch's grouped BF16 GEMM.
EXPERTS_DEQUANT_MIN_ROWS = 16384
EXPERTS_TILE = dict(BN=64, BK=128, num_warps=4, num_stages=3)


def experts_tile(rows: int, experts: int) -> dict:
    """The grouped FP8 kernel's launch for `rows` (token, expert) rows over `experts` experts."""
    mean = -(-rows // max(1, experts))
    return dict(BM=min(64, max(16, 1 << (mean - 1).bit_length())), **EXPERTS_TILE)


def expert_tiles(offs, rows: int, BM: int):
    """(expert of each tile [T] int32, -1 past the last tile; first row of each tile [T] int32) for rows grouped by
    expert (group e ends at offs[e]) cut into tiles of BM rows that never cross a group, with T = cdiv(rows, BM) + E
    (each group adds at most one partial tile): the static grid of triton_ops._fp8_grouped_kernel, which computes
    this map in registers (its reference, checked in the CPU tests)."""
    E = offs.shape[0]
    ends = offs.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    ntiles = (ends - starts + BM - 1) // BM
    cum = torch.cumsum(ntiles, 0)
    t = torch.arange(-(-rows // BM) + E, device=offs.device)
    e = torch.searchsorted(cum, t, right=True)  # the group whose tiles cover slot t
    ec = e.clamp(max=E - 1)
    first = starts[ec] + (t - (cum[ec] - ntiles[ec])) * BM
    return torch.where(e < E, ec, -1).to(torch.int32), first.to(torch.int32)
