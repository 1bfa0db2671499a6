"""Triton kernels for the decode-heavy parts of the engine; same contracts (and rounding) as
`ops.py`, which is their reference. Loaded only on CUDA.

Why these five: a decode step of a 0.5B model is ~200 small launches (replayed from a CUDA
graph), so fusing the elementwise chains (residual + RMSNorm, q/k-norm + RoPE + cache
write, SiLU * up) cuts the launch count by ~3x; paged attention needs its own kernel
anyway; and the sampler reads the [B, V] logits once from HBM (per-chunk max and sums of
exp, then an inverse-CDF draw over chunks and within one chunk, two Philox uniforms per row)
instead of the ~8 passes of the torch version. Top-k / top-p thresholds are searched over the
16-bit keys of the logits (eleven passes, no sort), so a filtered decode step is one graph too.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from polyrl.rollout.gpu import ops as _ref
from polyrl.rollout.gpu.ops import moe_route, prefill_attention, prefill_cu_seqlens, prefill_index  # noqa: F401  (torch; part of this module's interface)


class FP8Act(NamedTuple):
    """Activations already quantized for a w8a8 FP8 linear: E4M3 [M, K] and one float32 scale per token and 128
    columns [M, ceil(K / 128)], token-major; dtype: the model dtype they stand for (the linear's output dtype)."""
    q: torch.Tensor
    s: torch.Tensor
    dtype: torch.dtype


@triton.jit
def _quant_groups(y, q_ptr, s_ptr, cols, n, g0, KB, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
    # y [BLOCK] (columns `cols`, n valid) -> E4M3 into q_ptr + cols and one scale per 128 columns into s_ptr + group:
    # _act_quant_kernel's arithmetic on the same rounded values, so the result is the same bit for bit
    yf = tl.reshape(y.to(tl.float32), (BLOCK // 128, 128))
    amax = tl.max(tl.abs(yf), axis=1)
    sc = tl.where(amax > 0, amax / FP8_MAX, 1.0)
    q = tl.reshape(tl.clamp(yf / sc[:, None], -FP8_MAX, FP8_MAX), (BLOCK,))
    tl.store(q_ptr + cols, q.to(q_ptr.dtype.element_ty), mask=cols < n)
    g = g0 + tl.arange(0, BLOCK // 128)
    tl.store(s_ptr + g, sc, mask=g < KB)


@triton.jit
def _add_rmsnorm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, ys_ptr, H, KB, eps, HAS_RES: tl.constexpr,
                        QUANT: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=m, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(r_ptr + row * H + cols, mask=m, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(s_ptr + row * H + cols, x, mask=m)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / H
    n = (h * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=m, other=0.0)
    y = (n.to(tl.float32) * w.to(tl.float32)).to(x.dtype)
    if QUANT:
        _quant_groups(y, y_ptr + row * H, ys_ptr + row * KB, cols, H, 0, KB, FP8_MAX, BLOCK)
    else:
        tl.store(y_ptr + row * H + cols, y, mask=m)


def add_rmsnorm(x, residual, weight, eps):
    T, H = x.shape
    y = torch.empty_like(x)
    s = torch.empty_like(x) if residual is not None else x
    if T:
        _add_rmsnorm_kernel[(T,)](x, residual if residual is not None else x, weight, y, s, y, H, 1, eps,
                                  HAS_RES=residual is not None, QUANT=False, FP8_MAX=448.0,
                                  BLOCK=triton.next_power_of_2(H), num_warps=4)
    return y, s


def add_rmsnorm_fp8(x, residual, weight, eps):
    """add_rmsnorm whose normed output comes as FP8Act (what quantize_activations makes of add_rmsnorm's output, bit
    for bit) for a w8a8 linear: one launch fewer per linear at decode."""
    T, H = x.shape
    KB = triton.cdiv(H, 128)
    y = FP8Act(torch.empty(T, H, dtype=torch.float8_e4m3fn, device=x.device),
               torch.empty(T, KB, dtype=torch.float32, device=x.device), x.dtype)
    s = torch.empty_like(x) if residual is not None else x
    if T:
        _add_rmsnorm_kernel[(T,)](x, residual if residual is not None else x, weight, y.q, s, y.s, H, KB, eps,
                                  HAS_RES=residual is not None, QUANT=True, FP8_MAX=448.0,
                                  BLOCK=max(128, triton.next_power_of_2(H)), num_warps=4)
    return y, s


@triton.jit
def _rope_half(x1, x2, c, s):
    # (x * cos) + (rotate_half(x) * sin), each product and the sum rounded to the model dtype like HF
    dt = x1.dtype
    o1 = ((x1.to(tl.float32) * c).to(dt).to(tl.float32) + (-(x2.to(tl.float32)) * s).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2.to(tl.float32) * c).to(dt).to(tl.float32) + (x1.to(tl.float32) * s).to(dt).to(tl.float32)).to(dt)
    return o1, o2


@triton.jit
def _head_rms(x1, x2, w_ptr, eps, HALF: tl.constexpr, D: tl.constexpr):
    # Qwen3 per-head RMSNorm over the whole head (both halves)
    dt = x1.dtype
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    var = (tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / D
    r = tl.rsqrt(var + eps)[:, None]
    j = tl.arange(0, HALF)
    w1 = tl.load(w_ptr + j).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + j).to(tl.float32)[None, :]
    return ((a * r).to(dt).to(tl.float32) * w1).to(dt), ((b * r).to(dt).to(tl.float32) * w2).to(dt)


@triton.jit
def _rope_store_kernel(qkv_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, qn_ptr, kn_ptr,
                       ks_ptr, vs_ptr, eps, stride_qkv, stride_cs, stride_kc_s, stride_vc_s, stride_ks, stride_vs,
                       HQ: tl.constexpr, HKV: tl.constexpr, HQ_P: tl.constexpr, HKV_P: tl.constexpr, D: tl.constexpr,
                       QK_NORM: tl.constexpr, WRITE_K: tl.constexpr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = D // 2
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    j = tl.arange(0, HALF)
    c = tl.load(cos_ptr + pos * stride_cs + j).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * stride_cs + j).to(tl.float32)[None, :]
    base = qkv_ptr + t * stride_qkv
    # q heads
    hq = tl.arange(0, HQ_P)[:, None]
    mq = hq < HQ
    q1 = tl.load(base + hq * D + j[None, :], mask=mq, other=0.0)
    q2 = tl.load(base + hq * D + HALF + j[None, :], mask=mq, other=0.0)
    if QK_NORM:
        q1, q2 = _head_rms(q1, q2, qn_ptr, eps, HALF, D)
    q1, q2 = _rope_half(q1, q2, c, s)
    qo = q_ptr + t * (HQ * D) + hq * D + j[None, :]
    tl.store(qo, q1, mask=mq)
    tl.store(qo + HALF, q2, mask=mq)
    # k heads (rotated) and v heads (as is) into the cache
    hk = tl.arange(0, HKV_P)[:, None]
    mk = hk < HKV
    kb = base + HQ * D + hk * D + j[None, :]
    k1 = tl.load(kb, mask=mk, other=0.0)
    k2 = tl.load(kb + HALF, mask=mk, other=0.0)
    if QK_NORM:
        k1, k2 = _head_rms(k1, k2, kn_ptr, eps, HALF, D)
    k1, k2 = _rope_half(k1, k2, c, s)
    kco = kc_ptr + slot * stride_kc_s + hk * D + j[None, :]
    d = tl.arange(0, D)[None, :]
    v = tl.load(base + (HQ + HKV) * D + hk * D + d, mask=mk, other=0.0)
    if KV_FP8:  # E4M3 with one scale per (token, head): ops.quantize_heads' arithmetic
        a1, a2 = k1.to(tl.float32), k2.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(a1), axis=1), tl.max(tl.abs(a2), axis=1))
        sk = tl.where(amax > 0, amax / FP8_MAX, 1.0)
        tl.store(kco, tl.clamp(a1 / sk[:, None], -FP8_MAX, FP8_MAX).to(kc_ptr.dtype.element_ty), mask=mk)
        tl.store(kco + HALF, tl.clamp(a2 / sk[:, None], -FP8_MAX, FP8_MAX).to(kc_ptr.dtype.element_ty), mask=mk)
        hs = tl.arange(0, HKV_P)
        tl.store(ks_ptr + slot * stride_ks + hs, sk, mask=hs < HKV)
        vf = v.to(tl.float32)
        vmax = tl.max(tl.abs(vf), axis=1)
        sv = tl.where(vmax > 0, vmax / FP8_MAX, 1.0)
        tl.store(vc_ptr + slot * stride_vc_s + hk * D + d,
                 tl.clamp(vf / sv[:, None], -FP8_MAX, FP8_MAX).to(vc_ptr.dtype.element_ty), mask=mk)
        tl.store(vs_ptr + slot * stride_vs + hs, sv, mask=hs < HKV)
    else:
        tl.store(kco, k1, mask=mk)
        tl.store(kco + HALF, k2, mask=mk)
        tl.store(vc_ptr + slot * stride_vc_s + hk * D + d, v, mask=mk)
    if WRITE_K:
        ko = k_ptr + t * (HKV * D) + hk * D + j[None, :]
        tl.store(ko, k1, mask=mk)
        tl.store(ko + HALF, k2, mask=mk)


def rope_store(qkv, pos, slots, k_cache, v_cache, cos, sin, hq, hkv, d, q_norm=None, k_norm=None, eps=1e-6,
               write_k: bool = True, k_scale=None, v_scale=None):
    T = qkv.shape[0]
    q = torch.empty(T, hq, d, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(T, hkv, d, dtype=qkv.dtype, device=qkv.device) if write_k else q
    fp8 = k_scale is not None
    ks, vs = (k_scale, v_scale) if fp8 else (cos, cos)
    if T:
        _rope_store_kernel[(T,)](qkv, pos, slots, k_cache, v_cache, cos, sin, q, k,
                                 q_norm if q_norm is not None else cos, k_norm if k_norm is not None else cos,
                                 ks, vs, eps, qkv.stride(0), cos.stride(0), k_cache.stride(0), v_cache.stride(0),
                                 ks.stride(0), vs.stride(0),
                                 HQ=hq, HKV=hkv, HQ_P=triton.next_power_of_2(hq), HKV_P=triton.next_power_of_2(hkv), D=d,
                                 QK_NORM=q_norm is not None, WRITE_K=write_k, KV_FP8=fp8, FP8_MAX=448.0, num_warps=4)
    v = qkv[:, (hq + hkv) * d:].view(T, hkv, d)
    return q, (k if write_k else None), v


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, s_ptr, I, KB, QUANT: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    g = tl.load(gu_ptr + t * 2 * I + cols, mask=m, other=0.0)
    u = tl.load(gu_ptr + t * 2 * I + I + cols, mask=m, other=0.0)
    gf = g.to(tl.float32)
    a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    y = (a.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
    if QUANT:  # BLOCK is a multiple of 128: each program holds whole groups
        _quant_groups(y, out_ptr + t * I, s_ptr + t * KB, cols, I, tl.program_id(1) * (BLOCK // 128), KB, FP8_MAX,
                      BLOCK)
    else:
        tl.store(out_ptr + t * I + cols, y, mask=m)


def silu_mul(gu):
    T, I2 = gu.shape
    out = torch.empty(T, I2 // 2, dtype=gu.dtype, device=gu.device)
    if T:
        BLOCK = 1024
        _silu_mul_kernel[(T, triton.cdiv(I2 // 2, BLOCK))](gu, out, out, I2 // 2, 1, QUANT=False, FP8_MAX=448.0,
                                                            BLOCK=BLOCK, num_warps=4)
    return out


def silu_mul_fp8(gu):
    """silu_mul whose output comes as FP8Act (quantize_activations of silu_mul's output, bit for bit)."""
    T, I2 = gu.shape
    I = I2 // 2
    KB = triton.cdiv(I, 128)
    out = FP8Act(torch.empty(T, I, dtype=torch.float8_e4m3fn, device=gu.device),
                 torch.empty(T, KB, dtype=torch.float32, device=gu.device), gu.dtype)
    if T:
        BLOCK = 1024
        _silu_mul_kernel[(T, triton.cdiv(I, BLOCK))](gu, out.q, out.s, I, KB, QUANT=True, FP8_MAX=448.0, BLOCK=BLOCK,
                                                     num_warps=4)
    return out


@triton.jit
def _paged_decode_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, o_ptr, ml_ptr, split_ptr, ks_ptr, vs_ptr, scale,
                         stride_kc_s, stride_vc_s, stride_bt, stride_ks, stride_vs,
                         HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, G_P: tl.constexpr, D: tl.constexpr,
                         BS: tl.constexpr, BLOCK_N: tl.constexpr, NSPLIT: tl.constexpr, QUANT: tl.constexpr,
                         FP8_MAX: tl.constexpr, KV_FP8: tl.constexpr):
    # KV_FP8: the cache holds E4M3 with one scale per (token, head); the E4M3 tiles widen exactly to q's dtype and
    # each key's (value's) scale multiplies its score column (probability column): the same products as scaling the
    # keys and values first
    # one program per (sequence, kv head, context split): all G query heads of the kv head together
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    L = tl.load(ctx_ptr + b)
    if NSPLIT == 1:
        lo = 0
        hi = L
    else:  # the split length is read from device memory, so a captured graph follows the growing context
        split_len = tl.load(split_ptr)
        lo = sp * split_len
        hi = tl.minimum(L, lo + split_len)
    g = tl.arange(0, G_P)
    mg = g < G
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * (HQ * D) + (h * G + g)[:, None] * D + d[None, :], mask=mg[:, None], other=0.0)
    m_i = tl.full([G_P], -float("inf"), tl.float32)
    l_i = tl.zeros([G_P], tl.float32)
    acc = tl.zeros([G_P, D], tl.float32)
    qk_scale = scale * 1.4426950408889634  # exp2
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        mn = n < hi
        page = tl.load(bt_ptr + b * stride_bt + n // BS, mask=mn, other=0).to(tl.int64)
        slot = page * BS + n % BS
        k = tl.load(kc_ptr + slot[:, None] * stride_kc_s + h * D + d[None, :], mask=mn[:, None], other=0.0)
        if KV_FP8:
            sk = tl.load(ks_ptr + slot * stride_ks + h, mask=mn, other=0.0)
            s = tl.dot(q, tl.trans(k.to(q.dtype))) * (sk * qk_scale)[None, :]
        else:
            s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(mn[None, :], s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(vc_ptr + slot[:, None] * stride_vc_s + h * D + d[None, :], mask=mn[:, None], other=0.0)
        if KV_FP8:
            sv = tl.load(vs_ptr + slot * stride_vs + h, mask=mn, other=0.0)
            acc = acc * alpha[:, None] + tl.dot((p * sv[None, :]).to(q.dtype), v.to(q.dtype))
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if NSPLIT == 1:
        out = acc / l_i[:, None]
        if QUANT:  # E4M3 per head (D = 128: one activation group) into o_ptr, its scales into ml_ptr [B, HQ]
            qv, sc = _quant_rows(out.to(q_ptr.dtype.element_ty), FP8_MAX)
            tl.store(o_ptr + b * (HQ * D) + (h * G + g)[:, None] * D + d[None, :], qv.to(o_ptr.dtype.element_ty),
                     mask=mg[:, None])
            tl.store(ml_ptr + b * HQ + h * G + g, sc, mask=mg)
        else:
            tl.store(o_ptr + b * (HQ * D) + (h * G + g)[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty),
                     mask=mg[:, None])
    else:  # partial (unnormalized acc, max, sum) per split; merged by _merge_kernel
        row = (b * HQ + h * G + g) * NSPLIT + sp
        tl.store(o_ptr + row[:, None] * D + d[None, :], acc, mask=mg[:, None])
        tl.store(ml_ptr + row * 2, m_i, mask=mg)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=mg)


@triton.jit
def _quant_rows(y, FP8_MAX: tl.constexpr):
    # y [R, 128] in the model dtype -> (E4M3 values as fp32, one scale per row): _act_quant_kernel's arithmetic
    yf = y.to(tl.float32)
    amax = tl.max(tl.abs(yf), axis=1)
    sc = tl.where(amax > 0, amax / FP8_MAX, 1.0)
    return tl.clamp(yf / sc[:, None], -FP8_MAX, FP8_MAX), sc


@triton.jit
def _merge_kernel(part_ptr, ml_ptr, o_ptr, s_ptr, NSPLIT: tl.constexpr, NS_P: tl.constexpr, D: tl.constexpr,
                  DT: tl.constexpr, QUANT: tl.constexpr, FP8_MAX: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)  # (sequence, q head)
    sp = tl.arange(0, NS_P)
    ms = sp < NSPLIT
    m = tl.load(ml_ptr + (r * NSPLIT + sp) * 2, mask=ms, other=-float("inf"))
    l = tl.load(ml_ptr + (r * NSPLIT + sp) * 2 + 1, mask=ms, other=0.0)
    mx = tl.max(m, axis=0)
    w = tl.where(m > -float("inf"), tl.exp2(m - mx), 0.0)
    d = tl.arange(0, D)
    acc = tl.load(part_ptr + (r * NSPLIT + sp)[:, None] * D + d[None, :], mask=ms[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    if QUANT:  # one head's row (D = 128) is one activation group
        qv, sc = _quant_rows(tl.reshape(out.to(DT), (1, D)), FP8_MAX)
        tl.store(o_ptr + r * D + d, tl.reshape(qv, (D,)).to(o_ptr.dtype.element_ty))
        tl.store(s_ptr + r + tl.arange(0, 1), sc)
    else:
        tl.store(o_ptr + r * D + d, out.to(o_ptr.dtype.element_ty))


# launch settings of the decode kernel: the best of bench/decode_kernels.py --sweep at B = 64 and 256 on an H100
# (2026-11-24: 6.8 / 22.1 us vs 8.2 / 22.8 us for block_n 64)
DECODE_ATTN = {"block_n": 128, "num_warps": 4, "num_stages": 2}


def paged_decode_attention(q, k_cache, v_cache, block_tables, ctx_lens, block_size, num_splits: int = 1,
                           split_len: torch.Tensor | None = None, block_n: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None, fp8_out: bool = False, k_scale=None, v_scale=None):
    """num_splits > 1 (flash-decoding, for batches too small to fill the GPU) cuts each
    context into pieces of `split_len` tokens (a device int32 [1] that the caller keeps at
    >= longest context / num_splits), then merges the partial softmaxes. fp8_out (head_dim 128): the output comes
    as FP8Act [B, heads * 128] for a w8a8 linear, what quantize_activations makes of the BF16 output, bit for bit.
    k_scale, v_scale [S, Hkv]: the cache is E4M3 (--kv-cache-dtype fp8_e4m3), dequantized in the kernel."""
    B, hq, d = q.shape
    hkv = k_cache.shape[1]
    G = hq // hkv
    if fp8_out:
        assert d == 128, "fp8_out: one head per 128-column activation group"
        res = FP8Act(torch.empty(B, hq * d, dtype=torch.float8_e4m3fn, device=q.device),
                     torch.empty(B, hq, dtype=torch.float32, device=q.device), q.dtype)
        out = res.q.view(B, hq, d)
    else:
        res = out = torch.empty_like(q)
    BLOCK_N = block_n or DECODE_ATTN["block_n"]
    launch = dict(num_warps=num_warps or DECODE_ATTN["num_warps"], num_stages=num_stages or DECODE_ATTN["num_stages"])
    consts = dict(HQ=hq, HKV=hkv, G=G, G_P=max(16, triton.next_power_of_2(G)), D=d, BS=block_size, BLOCK_N=BLOCK_N,
                  KV_FP8=k_scale is not None)
    ks, vs = (k_scale, v_scale) if k_scale is not None else (ctx_lens, ctx_lens)  # unread without an FP8 cache
    if num_splits == 1:
        _paged_decode_kernel[(B, hkv, 1)](q, k_cache, v_cache, block_tables, ctx_lens, out,
                                          res.s if fp8_out else out, ctx_lens, ks, vs, d ** -0.5,
                                          k_cache.stride(0), v_cache.stride(0), block_tables.stride(0),
                                          ks.stride(0), vs.stride(0),
                                          NSPLIT=1, QUANT=fp8_out, FP8_MAX=448.0, **consts, **launch)
        return res
    part = torch.empty(B * hq * num_splits, d, dtype=torch.float32, device=q.device)
    ml = torch.empty(B * hq * num_splits, 2, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(B, hkv, num_splits)](q, k_cache, v_cache, block_tables, ctx_lens, part, ml, split_len, ks, vs,
                                               d ** -0.5, k_cache.stride(0), v_cache.stride(0), block_tables.stride(0),
                                               ks.stride(0), vs.stride(0),
                                               NSPLIT=num_splits, QUANT=False, FP8_MAX=448.0, **consts, **launch)
    _merge_kernel[(B * hq,)](part, ml, out, res.s if fp8_out else out, NSPLIT=num_splits,
                             NS_P=triton.next_power_of_2(num_splits), D=d,
                             DT=tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16, QUANT=fp8_out, FP8_MAX=448.0,
                             num_warps=1)
    return res


@triton.jit
def _chunk_stats_kernel(logits_ptr, stride_l, V, inv_temp_ptr, thresh_ptr, stats_ptr, NC: tl.constexpr,
                        CHUNK: tl.constexpr):
    # one program per (row, chunk of CHUNK columns): the chunk is read once (into registers) for its largest scaled
    # logit, the first column holding it, and the sums of exp(x - max) over all columns and over those the
    # top-k / top-p threshold keeps. The chunks are fixed, so the result does not depend on any launch setting.
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row * stride_l + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
    x = x * tl.load(inv_temp_ptr + row)
    mx = tl.max(x, axis=0)
    first = tl.min(tl.where(x == mx, cols, 2147483647), axis=0)  # ties: the first column, like torch.argmax
    e = tl.exp2((x - mx) * 1.4426950408889634)
    keep = x >= tl.load(thresh_ptr + row)
    p = stats_ptr + (row * NC + c) * 4
    tl.store(p, mx)
    tl.store(p + 1, tl.sum(e, axis=0))
    tl.store(p + 2, tl.sum(tl.where(keep, e, 0.0), axis=0))
    tl.store(p + 3, first.to(tl.float32))  # < 2**24: exact


@triton.jit
def _pick_kernel(logits_ptr, stride_l, V, inv_temp_ptr, noise_ptr, thresh_ptr, seed_ptr, ctr_ptr, stats_ptr, tok_ptr,
                 lp_ptr, NC: tl.constexpr, NC_P: tl.constexpr, CHUNK: tl.constexpr):
    # sampling by inverse CDF in two levels, each with its own uniform: a chunk with probability (its kept mass) /
    # (the row's kept mass), then a column of that chunk with probability exp(x) / (the chunk's kept mass). The
    # product is exactly the filtered softmax, and each level's fp32 prefix sums only span 64 chunks or CHUNK
    # columns. Greedy rows take the first column of the largest logit. Both report the log-probability of the
    # token under the unfiltered softmax of the scaled logits.
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, NC_P)
    mk = k < NC
    sp = stats_ptr + (row * NC + k) * 4
    m = tl.load(sp, mask=mk, other=-float("inf"))
    s_all = tl.load(sp + 1, mask=mk, other=0.0)
    s_keep = tl.load(sp + 2, mask=mk, other=0.0)
    M = tl.max(m, axis=0)
    w = tl.where(m > -float("inf"), tl.exp2((m - M) * 1.4426950408889634), 0.0)
    log_total = tl.log(tl.sum(s_all * w, axis=0))
    kept = s_keep * w
    cum = tl.cumsum(kept, axis=0)
    it = tl.load(inv_temp_ptr + row)
    if tl.load(noise_ptr + row) != 0:
        u0, u1, _, _ = tl.rand4x(tl.load(seed_ptr + row), tl.load(ctr_ptr + row).to(tl.int32))
        target = u0 * tl.sum(kept, axis=0)
        c = tl.min(tl.where((cum > target) & (kept > 0), k, NC_P), axis=0)
        c = tl.where(c == NC_P, tl.max(tl.where(kept > 0, k, -1), axis=0), c)  # rounding past the end: last kept chunk
        c = tl.maximum(c, 0)
        mc = tl.max(tl.where(k == c, m, -float("inf")), axis=0)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(logits_ptr + row * stride_l + cols, mask=cols < V, other=-float("inf")).to(tl.float32) * it
        e = tl.where(x >= tl.load(thresh_ptr + row), tl.exp2((x - mc) * 1.4426950408889634), 0.0)
        ce = tl.cumsum(e, axis=0)
        t = u1 * tl.sum(e, axis=0)
        tok = tl.min(tl.where((ce > t) & (e > 0), cols, 2147483647), axis=0)
        tok = tl.where(tok == 2147483647, tl.max(tl.where(e > 0, cols, -1), axis=0), tok)  # rounding: last kept
        xt = tl.max(tl.where(cols == tok, x, -float("inf")), axis=0)
    else:
        first = tl.load(sp + 3, mask=mk, other=3.0e38)
        tok = tl.min(tl.where(m == M, first, 3.0e38), axis=0).to(tl.int32)  # chunks hold increasing columns
        xt = M
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(lp_ptr + row, xt - M - log_total)


SAMPLE_CHUNK = 4096  # columns per chunk: 16 fp32 registers per thread of a 8-warp program, ~38 chunks at a 152k vocabulary


def sample(logits, inv_temp, noise, thresh, seeds, counters):
    """ops.sample's contract (the random stream differs): two launches, the logits read once from HBM."""
    B, V = logits.shape
    tok = torch.empty(B, dtype=torch.long, device=logits.device)
    lp = torch.empty(B, dtype=torch.float32, device=logits.device)
    if not B:
        return tok, lp
    chunk = min(SAMPLE_CHUNK, max(16, triton.next_power_of_2(V)))
    nc = triton.cdiv(V, chunk)
    stats = torch.empty(B * nc * 4, dtype=torch.float32, device=logits.device)
    _chunk_stats_kernel[(B, nc)](logits, logits.stride(0), V, inv_temp, thresh, stats, NC=nc, CHUNK=chunk, num_warps=8)
    _pick_kernel[(B,)](logits, logits.stride(0), V, inv_temp, noise, thresh, seeds, counters, stats, tok, lp, NC=nc,
                       NC_P=max(2, triton.next_power_of_2(nc)), CHUNK=chunk, num_warps=8)
    return tok, lp


@triton.jit
def _keys(logits_ptr, row, stride_l, cols, V):
    # a 16-bit float's bits as an order-preserving key in [0, 65536) (negatives flipped, positives offset); columns
    # past V get -1, below every key
    raw = tl.load(logits_ptr + row * stride_l + cols, mask=cols < V, other=0.0)
    bits = raw.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    key = tl.where((bits & 0x8000) != 0, (~bits) & 0xFFFF, bits | 0x8000)
    return tl.where(cols < V, key, -1), raw.to(tl.float32)


@triton.jit
def _key_value(key, DT: tl.constexpr):
    bits = tl.where((key & 0x8000) != 0, key & 0x7FFF, (~key) & 0xFFFF)
    return bits.to(tl.int16).to(DT, bitcast=True).to(tl.float32)


@triton.jit
def _search_step(part_ptr, row, S, lo, width, target, BY_COUNT: tl.constexpr):
    # one 16-way step of a search over keys, from the previous pass's per-segment sums at 16 pivots: top-k
    # (BY_COUNT) keeps the largest pivot with >= target keys at or above it; top-p the first sub-range whose last key
    # has at most `target` mass strictly above it
    j = tl.arange(0, 16)
    if BY_COUNT:
        tot = tl.zeros([16], tl.int32)
    else:
        tot = tl.zeros([16], tl.float32)
    for sg in range(0, S):
        tot += tl.load(part_ptr + (row * S + sg) * 16 + j)
    step = width // 16
    if BY_COUNT:
        jj = tl.max(tl.where(tot >= target, j, 0), axis=0)
    else:
        jj = tl.min(tl.where(tot <= target, j, 15), axis=0)
    return lo + jj * step, step


@triton.jit
def _filter_pass_kernel(logits_ptr, stride_l, V, S, seg_len, inv_temp_ptr, k_ptr, p_ptr, cnt_ptr, mass_ptr, red_ptr,
                        state_ptr, thr_ptr, PASS: tl.constexpr, DT: tl.constexpr, BLOCK: tl.constexpr):
    # pass PASS of the top-k / top-p threshold search, one program per (row, segment of seg_len columns); every program
    # of a row first rebuilds the search state from the previous pass's per-segment sums (tiny), so no pass waits for
    # another launch. Passes: 0-3 top-k (counts of keys >= 16 pivots), 4 max and 5 sum of exp over the top-k survivors,
    # 6-9 top-p (their exp mass strictly above 16 pivots), 10 the threshold (one program per row).
    # State per row (int32, two copies): [kk (lowest top-k key), lo, width]; a search narrows [lo, lo + width) 16-fold
    # a pass.
    row = tl.program_id(0).to(tl.int64)
    sg = tl.program_id(1)  # of S (the last pass runs one program per row)
    K = tl.load(k_ptr)
    P = tl.load(p_ptr)
    it = tl.load(inv_temp_ptr + row)
    topk = (K > 0) & (K < V)
    j = tl.arange(0, 16)
    # state and per-segment sums have two copies: a pass reads the one its predecessor wrote and writes the other, so
    # no program reads what another program of its own pass has already overwritten
    st = state_ptr + (row * 2 + PASS % 2) * 3
    st_next = state_ptr + (row * 2 + (PASS + 1) % 2) * 3
    half = (tl.num_programs(0) * S * 16).to(tl.int64)  # elements per copy of cnt / mass
    cnt_in, mass_in = cnt_ptr + ((PASS + 1) % 2) * half, mass_ptr + ((PASS + 1) % 2) * half
    cnt_out, mass_out = cnt_ptr + (PASS % 2) * half, mass_ptr + (PASS % 2) * half
    # -- rebuild the state left by the previous pass
    if PASS == 0:
        kk = 0
        lo = 0
        width = 65536
    elif PASS <= 4:
        kk = 0
        lo = tl.load(st + 1)
        width = tl.load(st + 2)
        lo, width = _search_step(cnt_in, row, S, lo, width, K, True)
        if PASS == 4:
            kk = tl.where(topk, lo, 0)
    else:
        kk = tl.load(st)
        lo = tl.load(st + 1)
        width = tl.load(st + 2)
    if PASS >= 5:  # the max over the survivors (pass 4's per-segment maxima)
        ms = tl.load(red_ptr + (row * S + tl.arange(0, 1024)) * 2, mask=tl.arange(0, 1024) < S, other=-float("inf"))
        M = tl.max(ms, axis=0)
    if PASS >= 6:
        zs = tl.load(red_ptr + (row * S + tl.arange(0, 1024)) * 2 + 1, mask=tl.arange(0, 1024) < S, other=0.0)
        limit = P * tl.sum(zs, axis=0)
        if PASS == 6:
            lo = 0
            width = 65536
        else:
            lo, width = _search_step(mass_in, row, S, lo, width, limit, False)
    if PASS == 10:
        thr = tl.where(topk, _key_value(kk, DT) * it, -float("inf"))
        if P < 1.0:
            thr = tl.maximum(thr, tl.where(lo > 0, _key_value(lo, DT) * it, -float("inf")))
        tl.store(thr_ptr + row, thr)
        return
    if sg == 0:
        tl.store(st_next, kk)
        tl.store(st_next + 1, lo)
        tl.store(st_next + 2, width)
    # a search that is not asked for reads nothing (the max of pass 4 only serves top-p's exponentials)
    skip = ((PASS < 4) & ~topk) | ((PASS >= 4) & (P >= 1.0))
    if skip:
        return
    step = width // 16
    offs = tl.arange(0, BLOCK)
    lo_c = sg * seg_len
    hi_c = tl.minimum(V, lo_c + seg_len)
    if PASS < 4:
        acc = tl.zeros([BLOCK, 16], tl.int32)
        piv = lo + j * step
        for start in range(lo_c, hi_c, BLOCK):
            key, _x = _keys(logits_ptr, row, stride_l, start + offs, hi_c)
            acc += (key[:, None] >= piv[None, :]).to(tl.int32)
        tl.store(cnt_out + (row * S + sg) * 16 + j, tl.sum(acc, axis=0))
    elif PASS == 4:
        mx = tl.full([BLOCK], -float("inf"), tl.float32)
        for start in range(lo_c, hi_c, BLOCK):
            key, x = _keys(logits_ptr, row, stride_l, start + offs, hi_c)
            mx = tl.maximum(mx, tl.where(key >= kk, x * it, -float("inf")))
        tl.store(red_ptr + (row * S + sg) * 2, tl.max(mx, axis=0))
    elif PASS == 5:
        z = tl.zeros([BLOCK], tl.float32)
        for start in range(lo_c, hi_c, BLOCK):
            key, x = _keys(logits_ptr, row, stride_l, start + offs, hi_c)
            z += tl.where(key >= kk, tl.exp(x * it - M), 0.0)
        tl.store(red_ptr + (row * S + sg) * 2 + 1, tl.sum(z, axis=0))
    else:
        acc = tl.zeros([BLOCK, 16], tl.float32)
        last = lo + (j + 1) * step - 1  # the last key of each of the 16 sub-ranges
        for start in range(lo_c, hi_c, BLOCK):
            key, x = _keys(logits_ptr, row, stride_l, start + offs, hi_c)
            e = tl.where(key >= kk, tl.exp(x * it - M), 0.0)
            acc += tl.where(key[:, None] > last[None, :], e[:, None], 0.0)
        tl.store(mass_out + (row * S + sg) * 16 + j, tl.sum(acc, axis=0))


FILTER_BLOCK, FILTER_WARPS, FILTER_SEGMENT = 256, 4, 8192  # the best of bench/decode_kernels.py --only sampler --sweep (H100)


def filter_thresholds(logits, inv_temp, top_k, top_p):
    """ops.filter_thresholds's contract for BF16 / FP16 logits without a sort (others: the torch reference): eleven
    launches of (row, segment) programs, each pass reading the logits once. top_k and top_p may be 1-element device
    tensors (int32, fp32), which a captured CUDA graph reads at each replay. Ties share a key, as they share a value
    in ops.py; top-p sums fp32 exponentials in another order than the torch reference, so a token whose cumulative
    mass is within fp32 rounding of top_p may fall on the other side."""
    if logits.dtype not in (torch.bfloat16, torch.float16):
        return _ref.filter_thresholds(logits, inv_temp, int(top_k), float(top_p))
    B, V = logits.shape
    dev = logits.device
    k = top_k if torch.is_tensor(top_k) else torch.tensor([top_k], dtype=torch.int32, device=dev)
    p = top_p if torch.is_tensor(top_p) else torch.tensor([top_p], dtype=torch.float32, device=dev)
    thr = torch.empty(B, dtype=torch.float32, device=dev)
    if not B:
        return thr
    S = min(1024, triton.cdiv(V, FILTER_SEGMENT))
    seg_len = triton.cdiv(triton.cdiv(V, S), FILTER_BLOCK) * FILTER_BLOCK
    S = triton.cdiv(V, seg_len)
    cnt = torch.empty(2 * B * S * 16, dtype=torch.int32, device=dev)
    mass = torch.empty(2 * B * S * 16, dtype=torch.float32, device=dev)
    red = torch.empty(B * S * 2, dtype=torch.float32, device=dev)
    state = torch.empty(B * 2 * 3, dtype=torch.int32, device=dev)
    dt = tl.bfloat16 if logits.dtype == torch.bfloat16 else tl.float16
    for ps in range(11):
        _filter_pass_kernel[(B, S if ps < 10 else 1)](logits, logits.stride(0), V, S, seg_len, inv_temp, k, p, cnt, mass,
                                                       red, state, thr, PASS=ps, DT=dt, BLOCK=FILTER_BLOCK,
                                                       num_warps=FILTER_WARPS)
    return thr


# ---- MoE experts -----------------------------------------------------------------------------
_GROUPED_MM = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _grouped_mm_ok(x, w) -> bool:
    """torch's grouped GEMM (CUTLASS, SM80+ on torch >= 2.9) takes BF16 with 16-byte aligned rows; its other
    dtypes go through a fallback that reads the group sizes on the host, which a CUDA graph cannot capture."""
    return (_GROUPED_MM is not None and x.dtype == w.dtype == torch.bfloat16 and x.shape[1] % 8 == 0
            and w.shape[1] % 8 == 0 and torch.cuda.get_device_capability(x.device) >= (8, 0))


def grouped_linear(x, w, offs):
    """ops.grouped_linear's contract, without host syncs where a CUDA graph is being captured."""
    if _grouped_mm_ok(x, w):
        return _GROUPED_MM(x, w.transpose(-2, -1), offs=offs)
    if not torch.cuda.is_current_stream_capturing():
        return _ref.grouped_linear(x, w, offs)
    # graph-safe fallback (FP32/FP16 decode): every expert's GEMM over all rows, each row keeping its own expert's
    # result; E times the FLOPs of the grouped GEMM, but decode batches are small
    group = torch.searchsorted(offs, torch.arange(x.shape[0], device=x.device, dtype=offs.dtype), right=True)
    out = x.new_zeros(x.shape[0], w.shape[1])
    for e in range(w.shape[0]):
        out = torch.where((group == e)[:, None], F.linear(x, w[e]), out)
    return out


def moe_experts(x, gate_up, down, gates, experts, scales=None):
    """ops.moe_experts' contract. FP8 experts (scales given; fp8.EXPERTS_DEQUANT_MIN_ROWS says which path): fewer
    (token, expert) rows run the grouped FP8 kernel (fp8_grouped_linear, weight-only: the emulation's weight rounding,
    fp32 sums), more (prefill) dequantize the layer's experts into a transient copy of x's dtype, bit for bit the
    emulation's weights, for the grouped BF16 GEMM; FP32 activations take the dequantized experts too."""
    if scales is None:
        return _ref.moe_experts(x, gate_up, down, gates, experts, grouped=grouped_linear, act=silu_mul)
    from polyrl.rollout.gpu.fp8 import EXPERTS_DEQUANT_MIN_ROWS, dequantize
    rows = x.shape[0] * experts.shape[1]
    if x.dtype not in (torch.bfloat16, torch.float16):
        gate_up, down = dequantize(gate_up, scales[0], scales[1], x.dtype), dequantize(down, scales[2], scales[3], x.dtype)
        return _ref.moe_experts(x, gate_up, down, gates, experts, grouped=grouped_linear, act=silu_mul)
    if rows >= EXPERTS_DEQUANT_MIN_ROWS:
        def grouped(xr, w, offs, scale, row_div):  # one transient weight at a time: gate|up's is freed before down's
            return grouped_linear(xr, fp8_dequantize(w, scale, row_div, xr.dtype), offs)
    else:
        def grouped(xr, w, offs, scale, row_div):
            return fp8_grouped_linear(xr, w, scale, offs, row_div)
    return _ref.moe_experts(x, gate_up, down, gates, experts, grouped=grouped, act=silu_mul, scales=scales)


@triton.jit
def _fp8_grouped_kernel(x_ptr, w_ptr, s_ptr, y_ptr, ends_ptr, E, N, K, stride_xm, stride_we, stride_wn, stride_se,
                        stride_sn, stride_ym, ROW_DIV: tl.constexpr, EP: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr):
    # _fp8_linear_kernel's arithmetic (FP8 weight tile * its block scale in fp32, rounded to the activations' dtype,
    # fp32 accumulation) over rows grouped by expert (group e ends at ends[e]). Program (t, n) finds its tile in
    # registers, fp8.expert_tiles' map: groups cut into tiles of BM rows, numbered group after group; slot t belongs to
    # the first group whose cumulative tile count exceeds t (slots past the last tile exit). It multiplies the tile's
    # rows by weight rows [n BN, (n + 1) BN) of that expert. Tiles of one expert are adjacent on the fastest grid
    # axis, so its weight tile is read from HBM about once.
    t = tl.program_id(0)
    idx = tl.arange(0, EP)
    ends = tl.load(ends_ptr + idx, mask=idx < E, other=0)
    starts = tl.load(ends_ptr + idx - 1, mask=(idx > 0) & (idx < E), other=0)
    ntiles = tl.where(idx < E, (ends - starts + BM - 1) // BM, 0)
    cum = tl.cumsum(ntiles, 0)
    e = tl.sum((cum <= t).to(tl.int32), 0)
    if e >= E:
        return
    sel = idx == e
    r1 = tl.sum(tl.where(sel, ends, 0), 0)
    r0 = tl.sum(tl.where(sel, starts + (t - (cum - ntiles)) * BM, 0), 0)
    offs_m = r0 + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mm = offs_m < r1
    mn = offs_n < N
    rk = tl.arange(0, BK)
    w_rows = w_ptr + e.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + e.to(tl.int64) * stride_se + (offs_n // ROW_DIV).to(tl.int64) * stride_sn
    x_cols = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + rk
        mk = ks < K
        w = tl.load(w_rows + ks[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
        sc = tl.load(s_rows + k0 // 128, mask=mn, other=0.0)
        xt = tl.load(x_cols + ks[:, None], mask=mk[:, None] & mm[None, :], other=0.0)
        acc = tl.dot((w.to(tl.float32) * sc[:, None]).to(xt.dtype), xt, acc)
    y_off = offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=mn[:, None] & mm[None, :])


def fp8_grouped_linear(x, w, scale, offs, row_div: int = 128, config: dict | None = None):
    """x [S, K] (BF16/FP16) rows grouped by expert (ends offs [E] int32), w float8_e4m3fn [E, N, K] with block scales
    [E, rows, ceil(K / 128)] (polyrl.rollout.gpu.fp8) -> [S, N]: ops.grouped_linear on the experts dequantized to x's
    dtype, up to fp32 summation order. One launch of a static grid, cdiv(S, BM) + E tile slots (each group adds at most
    one partial tile), no host syncs: CUDA-graph safe."""
    from polyrl.rollout.gpu.fp8 import experts_tile
    S, K = x.shape
    E, N, _ = w.shape
    y = torch.empty(S, N, dtype=x.dtype, device=x.device)
    if not S:
        return y
    if x.stride(1) != 1:
        x = x.contiguous()
    c = config or experts_tile(S, E)
    grid = (triton.cdiv(S, c["BM"]) + E, triton.cdiv(N, c["BN"]))
    _fp8_grouped_kernel[grid](x, w, scale, y, offs, E, N, K, x.stride(0), w.stride(0), w.stride(1), scale.stride(0),
                              scale.stride(1), y.stride(0), ROW_DIV=row_div, EP=triton.next_power_of_2(E), BM=c["BM"],
                              BN=c["BN"], BK=c["BK"], num_warps=c["num_warps"], num_stages=c["num_stages"])
    return y


# ---- FP8 linears (--rollout-quantization fp8) ---------------------------------------------------
@triton.jit
def _fp8_store(acc, y_ptr, p_ptr, cnt_ptr, b_ptr, offs_m, offs_n, M, N, stride_ym, HAS_BIAS: tl.constexpr,
               PARTIAL: tl.constexpr):
    # acc [BN, BM] (weight rows x tokens) -> y [M, N]. PARTIAL (K split over grid axis 2): fp32 partial sums into
    # p [SPLIT, M, N]; the tile's last program to finish (a counter per tile, left at zero for the next launch) adds
    # them in split order, whichever program that is, so the sum is fixed (deterministic) and no second launch is
    # needed. The barrier and the acq_rel atomic order every thread's partial before the count that publishes it.
    mn = offs_n < N
    mm = offs_m < M
    msk = mn[:, None] & mm[None, :]
    y_off = offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
    if PARTIAL:
        n_split = tl.num_programs(2)
        p_off = offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
        mn_size = tl.program_id(2).to(tl.int64) * 0 + M * N  # int64 (M, N may come specialized as Python ints)
        tl.store(p_ptr + tl.program_id(2).to(tl.int64) * mn_size + p_off, acc, mask=msk)
        tl.debug_barrier()
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        if tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu") == n_split - 1:
            acc = tl.zeros_like(acc)
            for sp in range(0, n_split):
                acc += tl.load(p_ptr + sp * mn_size + p_off, mask=msk, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)[:, None]
            tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=msk)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=msk)


@triton.jit
def _fp8_linear_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, p_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
                       stride_ym, k_per_split, ROW_DIV: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # weight-only FP8: one program per (BM tokens, BN weight rows, K split). The weight tile is loaded as FP8 (the
    # bytes that bound decode), scaled by its block's scale in fp32 and rounded to the activations' dtype (the
    # rounding the CPU emulation's dequantized weights get), then multiplied with fp32 accumulation. The weight is
    # the left operand (y^T = w x^T): decode has few tokens, and the MMA's wide side is the weight rows'. The token
    # tiles are the fastest grid axis, so those of one weight tile run together and read it from HBM once.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = pid_m * BM + tl.arange(0, BM)
    mn = offs_n < N
    mm = offs_m < M
    rk = tl.arange(0, BK)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_cols = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm
    s_rows = s_ptr + (offs_n // ROW_DIV).to(tl.int64) * stride_sn
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        ks = k0 + rk
        mk = ks < k_hi
        w = tl.load(w_rows + ks[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
        s = tl.load(s_rows + k0 // 128, mask=mn, other=0.0)
        xt = tl.load(x_cols + ks[:, None], mask=mk[:, None] & mm[None, :], other=0.0)
        wb = (w.to(tl.float32) * s[:, None]).to(xt.dtype)
        acc = tl.dot(wb, xt, acc)
    _fp8_store(acc, y_ptr, p_ptr, cnt_ptr, b_ptr, offs_m, offs_n, M, N, stride_ym, HAS_BIAS, PARTIAL)


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_sm, stride_sg, FP8_MAX: tl.constexpr,
                      G: tl.constexpr):
    # one program per (token, group of G=128 columns): the group's largest |x| onto 448, like the weight blocks; the
    # scales go to s[m * stride_sm + g * stride_sg] (token-major for the Triton kernel, group-major for cuBLAS).
    # Rows from M on (padding) get zeros with scale 1.
    m = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    cols = g * G + tl.arange(0, G)
    mk = cols < K
    x = tl.load(x_ptr + m * stride_xm + cols, mask=mk & (m + 0 * cols < M), other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    sc = tl.where(amax > 0, amax / FP8_MAX, 1.0)
    q = tl.clamp(x / sc, -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + m * K + cols, q.to(q_ptr.dtype.element_ty), mask=mk)
    tl.store(s_ptr + m * stride_sm + g * stride_sg, sc)


@triton.jit
def _fp8_w8a8_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, b_ptr, y_ptr, p_ptr, cnt_ptr, M, N, K, KB, stride_xm, stride_wn,
                     stride_sn, stride_ym, k_per_split, ROW_DIV: tl.constexpr, HAS_BIAS: tl.constexpr,
                     PARTIAL: tl.constexpr, QUANT_X: tl.constexpr, FP8_MAX: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr):
    # FP8 x FP8 tensor-core products, each k-tile's fp32 result scaled by the weight block's and the token group's
    # scales; tiles and grid as _fp8_linear_kernel's. The activations come quantized (per token and 128 columns, by
    # _act_quant_kernel), or, with QUANT_X (BK = 128: a k-tile is one group), as they are, quantized here with the
    # same arithmetic, which saves a launch and the FP8 copy's round trip at decode.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = pid_m * BM + tl.arange(0, BM)
    mn = offs_n < N
    mm = offs_m < M
    rk = tl.arange(0, BK)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_cols = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm
    s_rows = s_ptr + (offs_n // ROW_DIV).to(tl.int64) * stride_sn
    xs_cols = xs_ptr + offs_m.to(tl.int64) * KB
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        ks = k0 + rk
        mk = ks < k_hi
        w = tl.load(w_rows + ks[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
        sw = tl.load(s_rows + k0 // 128, mask=mn, other=0.0)
        xt = tl.load(x_cols + ks[:, None], mask=mk[:, None] & mm[None, :], other=0.0)
        if QUANT_X:
            xf = xt.to(tl.float32)
            amax = tl.max(tl.abs(xf), axis=0)
            sx = tl.where(amax > 0, amax / FP8_MAX, 1.0)
            xt = tl.clamp(xf / sx[None, :], -FP8_MAX, FP8_MAX).to(w.dtype)
        else:
            sx = tl.load(xs_cols + k0 // 128, mask=mm, other=0.0)
        acc += tl.dot(w, xt) * sw[:, None] * sx[None, :]
    _fp8_store(acc, y_ptr, p_ptr, cnt_ptr, b_ptr, offs_m, offs_n, M, N, stride_ym, HAS_BIAS, PARTIAL)


@triton.jit
def _fp8_dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_we, stride_se,
                        ROW_DIV: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # q * scale in fp32, rounded once to the output dtype: fp8.dequantize's arithmetic, element for element; grid
    # axis 2 walks the matrices of a stack (experts), each with its own scale grid
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_k = tl.program_id(1) * BK + tl.arange(0, BK)
    m = tl.program_id(2).to(tl.int64)
    msk = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    w = tl.load(w_ptr + m * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :], mask=msk, other=0.0)
    s = tl.load(s_ptr + m * stride_se + (offs_n // ROW_DIV).to(tl.int64)[:, None] * stride_sn + (offs_k // 128)[None, :],
                mask=msk, other=0.0)
    tl.store(out_ptr + m * N * K + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :],
             (w.to(tl.float32) * s).to(out_ptr.dtype.element_ty), mask=msk)


def fp8_dequantize(w, scale, row_div: int = 128, dtype: torch.dtype = torch.bfloat16):
    """fp8.dequantize(w, scale, row_div, dtype) on the GPU: [..., N, K] in `dtype` (a stack of matrices, e.g. experts
    [E, N, K] with scales [E, rows, ceil(K / 128)], each by its own grid), bit for bit the CPU emulation's weight."""
    N, K = w.shape[-2:]
    M = w.shape[0] if w.dim() == 3 else 1
    out = torch.empty(*w.shape, dtype=dtype, device=w.device)
    if not out.numel():
        return out
    _fp8_dequant_kernel[(triton.cdiv(N, 64), triton.cdiv(K, 128), M)](
        w, scale, out, N, K, w.stride(-2), scale.stride(-2), w.stride(0) if M > 1 else 0,
        scale.stride(0) if M > 1 else 0, ROW_DIV=row_div, BN=64, BK=128, num_warps=4)
    return out


def quantize_activations(x, group_major: bool = False, rows: int | None = None):
    """x [M, K] -> (E4M3 [R, K], float32 scales [R, ceil(K / 128)]) with R = rows or M: each token's 128-column group
    scaled so its largest |x| is 448; rows past M are zeros with scale 1. group_major: the scales stored group by
    group (stride (1, R)), cuBLAS's 1x128 layout."""
    M, K = x.shape
    R = rows or M
    KB = triton.cdiv(K, 128)
    xq = torch.empty(R, K, dtype=torch.float8_e4m3fn, device=x.device)
    xs = torch.empty(KB, R, dtype=torch.float32, device=x.device).t() if group_major else \
        torch.empty(R, KB, dtype=torch.float32, device=x.device)
    if R:
        _act_quant_kernel[(R, KB)](x, xq, xs, M, K, x.stride(0), xs.stride(0), xs.stride(1), FP8_MAX=448.0, G=128,
                                   num_warps=1)
    return xq, xs


_SMS: dict[int, int] = {}
_COUNTERS: dict[torch.device, torch.Tensor] = {}
SPLIT_TILES = 8192  # output tiles a split-K launch may have (one counter each)


def _split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The split-K kernels' per-tile counters: one zeroed buffer per device, made on first use (the engine's eager
    warm-up, before any graph capture) and left zeroed by every launch, so launches on one stream share it."""
    if tiles > SPLIT_TILES:
        raise ValueError(f"a split-K FP8 launch of {tiles} output tiles: more than SPLIT_TILES ({SPLIT_TILES})")
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(SPLIT_TILES, dtype=torch.int32, device=device)
    return _COUNTERS[device]
_BLOCKWISE_MM: dict[int, bool] = {}
# "w8a8" (default, the faster: bench/RESULTS.md): activations quantized per token and 128 columns too, FP8
# tensor-core products (SGLang's block-FP8 scheme); "w8a16": weight-only (FP8 weight tiles scaled to BF16 in
# registers, BF16 products, or the dequantized weight for cuBLAS): exactly the CPU emulation's weight rounding
FP8_MODE = "w8a8"


def blockwise_mm_available(device: torch.device) -> bool:
    """Whether torch's scaled GEMM takes 1x128 activation and 128x128 weight scales here: cuBLAS has them on Hopper
    (SM 9.0) from CUDA 12.9; torch takes them through F.scaled_mm's BlockWise recipes (or, before it had F.scaled_mm,
    through torch._scaled_mm, which reads the recipe from the scales' shapes)."""
    dev = device.index if device.index is not None else torch.cuda.current_device()
    if dev not in _BLOCKWISE_MM:
        cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
        _BLOCKWISE_MM[dev] = ((hasattr(F, "scaled_mm") or hasattr(torch, "_scaled_mm"))
                              and torch.cuda.get_device_capability(dev) == (9, 0) and cuda >= (12, 9))
    return _BLOCKWISE_MM[dev]


def blockwise_mm(xq, xs, w, scale, out_dtype: torch.dtype):
    """y = (xq * xs) @ (w * scale)^T by cuBLAS: xq E4M3 [M, K] with 1x128 scales xs [M, K/128] (group-major), w E4M3
    [N, K] with its 128x128 block scales [N/128, K/128], fp32 accumulation, one rounding to out_dtype."""
    if hasattr(F, "scaled_mm"):
        T = F.ScalingType
        return F.scaled_mm(xq, w.t(), xs, T.BlockWise1x128, scale.t(), T.BlockWise128x128, output_dtype=out_dtype)
    return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=scale.t(), out_dtype=out_dtype)


def _device_sms(device: torch.device) -> int:
    dev = device.index if device.index is not None else torch.cuda.current_device()
    if dev not in _SMS:
        _SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    return _SMS[dev]


def fp8_activations(M: int, dtype: torch.dtype) -> bool:
    """Whether the model should hand its FP8 linears at M tokens E4M3 activations from their producers (add_rmsnorm_fp8,
    silu_mul_fp8): in w8a8 mode at the sizes the Triton kernel serves (fp8.SCALED_MM_MIN_M: cuBLAS's GEMM takes its
    scales group-major), for the model dtypes the kernels take."""
    from polyrl.rollout.gpu.fp8 import SCALED_MM_MIN_M
    return FP8_MODE == "w8a8" and M < SCALED_MM_MIN_M and dtype in (torch.bfloat16, torch.float16)


def fp8_linear(x, w, scale, bias=None, row_div: int = 128, config: dict | None = None, mode: str | None = None):
    """ops.fp8_linear's contract (w8a16: same weight rounding, fp32 sums in another order; w8a8: the activations
    rounded to E4M3 per 128-column group as well), by the path fp8.kernel_config picks for the shape:
      triton     the FP8 kernels (decode sizes): one launch (K split or not: the last program of a tile adds the
                 partial sums in a fixed order), plus one to quantize the activations (w8a8, unless x comes quantized
                 as FP8Act or the config has quant_x). No host syncs: CUDA-graph safe (one stream at a time).
      dequant    large M (prefill, bound by the products, not by the weight's bytes): the weight dequantized into a
                 transient matrix of x's dtype, bit for bit the emulation's, then cuBLAS (F.linear)
      scaled_mm  large M, w8a8: the activations quantized as the kernel does, then cuBLAS's block-scaled FP8 GEMM
    FP32 activations take the torch reference."""
    pre = isinstance(x, FP8Act)
    if not pre and x.dtype not in (torch.bfloat16, torch.float16):
        return _ref.fp8_linear(x, w, scale, bias, row_div)
    mode = "w8a8" if pre else mode or FP8_MODE
    from polyrl.rollout.gpu.fp8 import kernel_config
    M, K = x.q.shape if pre else x.shape
    dtype, device = (x.dtype, x.q.device) if pre else (x.dtype, x.device)
    N = w.shape[0]
    if not M:
        return torch.empty(M, N, dtype=dtype, device=device)
    if not pre and x.stride(1) != 1:
        x = x.contiguous()
    c = config or kernel_config(M, N, K, _device_sms(device), mode, row_div, not pre and blockwise_mm_available(device))
    if c["path"] == "scaled_mm":  # cuBLAS wants the 1x128 scales' rows 16-byte aligned: M padded to a multiple of 16
        xq, xs = quantize_activations(x, group_major=True, rows=-(-M // 16) * 16)
        if bias is None:
            return blockwise_mm(xq, xs, w, scale, dtype)[:M]
        return (blockwise_mm(xq, xs, w, scale, torch.float32)[:M] + bias.float()).to(dtype)  # one rounding
    if c["path"] == "dequant":
        return F.linear(x, fp8_dequantize(w, scale, row_div, dtype), bias)
    if pre and c.get("quant_x"):
        raise ValueError("quantized activations (FP8Act) go to a config without quant_x")
    y = torch.empty(M, N, dtype=dtype, device=device)
    split = c["split"]
    grid = (triton.cdiv(M, c["BM"]), triton.cdiv(N, c["BN"]), split)
    b = bias if bias is not None else scale
    part, cnt = y, y
    if split > 1:
        part = torch.empty(split, M, N, dtype=torch.float32, device=device)
        cnt = _split_counters(device, grid[0] * grid[1])
    launch = dict(ROW_DIV=row_div, HAS_BIAS=bias is not None, PARTIAL=split > 1, BM=c["BM"], BN=c["BN"], BK=c["BK"],
                  num_warps=c["num_warps"], num_stages=c["num_stages"])
    if mode == "w8a8":
        quant_x = c.get("quant_x", False)
        if pre:
            xq, xs = x.q, x.s
        elif quant_x:
            xq, xs = x, scale  # xs unused: the kernel quantizes its own tiles
        else:
            xq, xs = quantize_activations(x)
        _fp8_w8a8_kernel[grid](xq, xs, w, scale, b, y, part, cnt, M, N, K, triton.cdiv(K, 128), xq.stride(0),
                               w.stride(0), scale.stride(0), y.stride(0), c["k_per_split"], QUANT_X=quant_x,
                               FP8_MAX=448.0, **launch)
    else:
        _fp8_linear_kernel[grid](x, w, scale, b, y, part, cnt, M, N, K, x.stride(0), w.stride(0), scale.stride(0),
                                 y.stride(0), c["k_per_split"], **launch)
    return y
