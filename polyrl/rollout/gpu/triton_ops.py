"""Triton kernels for the decode-heavy parts of the engine; same contracts (and rounding) as
`ops.py`, which is their reference. Loaded only on CUDA.

Why these five: a decode step of a 0.5B model is ~200 small launches (replayed from a CUDA
graph), so fusing the elementwise chains (residual + RMSNorm, q/k-norm + RoPE + cache
write, SiLU * up) cuts the launch count by ~3x; paged attention needs its own kernel
anyway; and the sampler reads the [B, V] logits once (online logsumexp + Gumbel-max with a
counter-based Philox stream per row) instead of the ~8 passes of the torch version.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from polyrl.rollout.gpu import ops as _ref
from polyrl.rollout.gpu.ops import moe_route, prefill_attention, prefill_index  # noqa: F401  (torch; part of this module's interface)


@triton.jit
def _add_rmsnorm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, H, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
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
    tl.store(y_ptr + row * H + cols, (n.to(tl.float32) * w.to(tl.float32)).to(x.dtype), mask=m)


def add_rmsnorm(x, residual, weight, eps):
    T, H = x.shape
    y = torch.empty_like(x)
    s = torch.empty_like(x) if residual is not None else x
    if T:
        _add_rmsnorm_kernel[(T,)](x, residual if residual is not None else x, weight, y, s, H, eps,
                                  HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(H), num_warps=4)
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
                       eps, stride_qkv, stride_cs, stride_kc_s, stride_vc_s,
                       HQ: tl.constexpr, HKV: tl.constexpr, HQ_P: tl.constexpr, HKV_P: tl.constexpr, D: tl.constexpr,
                       QK_NORM: tl.constexpr, WRITE_K: tl.constexpr):
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
    tl.store(kco, k1, mask=mk)
    tl.store(kco + HALF, k2, mask=mk)
    if WRITE_K:
        ko = k_ptr + t * (HKV * D) + hk * D + j[None, :]
        tl.store(ko, k1, mask=mk)
        tl.store(ko + HALF, k2, mask=mk)
    d = tl.arange(0, D)[None, :]
    v = tl.load(base + (HQ + HKV) * D + hk * D + d, mask=mk, other=0.0)
    tl.store(vc_ptr + slot * stride_vc_s + hk * D + d, v, mask=mk)


def rope_store(qkv, pos, slots, k_cache, v_cache, cos, sin, hq, hkv, d, q_norm=None, k_norm=None, eps=1e-6,
               write_k: bool = True):
    T = qkv.shape[0]
    q = torch.empty(T, hq, d, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(T, hkv, d, dtype=qkv.dtype, device=qkv.device) if write_k else q
    if T:
        _rope_store_kernel[(T,)](qkv, pos, slots, k_cache, v_cache, cos, sin, q, k,
                                 q_norm if q_norm is not None else cos, k_norm if k_norm is not None else cos,
                                 eps, qkv.stride(0), cos.stride(0), k_cache.stride(0), v_cache.stride(0),
                                 HQ=hq, HKV=hkv, HQ_P=triton.next_power_of_2(hq), HKV_P=triton.next_power_of_2(hkv), D=d,
                                 QK_NORM=q_norm is not None, WRITE_K=write_k, num_warps=4)
    v = qkv[:, (hq + hkv) * d:].view(T, hkv, d)
    return q, (k if write_k else None), v


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    g = tl.load(gu_ptr + t * 2 * I + cols, mask=m, other=0.0)
    u = tl.load(gu_ptr + t * 2 * I + I + cols, mask=m, other=0.0)
    gf = g.to(tl.float32)
    a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + t * I + cols, (a.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=m)


def silu_mul(gu):
    T, I2 = gu.shape
    out = torch.empty(T, I2 // 2, dtype=gu.dtype, device=gu.device)
    if T:
        BLOCK = 1024
        _silu_mul_kernel[(T, triton.cdiv(I2 // 2, BLOCK))](gu, out, I2 // 2, BLOCK=BLOCK, num_warps=4)
    return out


@triton.jit
def _paged_decode_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, o_ptr, ml_ptr, split_ptr, scale,
                         stride_kc_s, stride_vc_s, stride_bt,
                         HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, G_P: tl.constexpr, D: tl.constexpr,
                         BS: tl.constexpr, BLOCK_N: tl.constexpr, NSPLIT: tl.constexpr):
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
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(mn[None, :], s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(vc_ptr + slot[:, None] * stride_vc_s + h * D + d[None, :], mask=mn[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if NSPLIT == 1:
        out = acc / l_i[:, None]
        tl.store(o_ptr + b * (HQ * D) + (h * G + g)[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=mg[:, None])
    else:  # partial (unnormalized acc, max, sum) per split; merged by _merge_kernel
        row = (b * HQ + h * G + g) * NSPLIT + sp
        tl.store(o_ptr + row[:, None] * D + d[None, :], acc, mask=mg[:, None])
        tl.store(ml_ptr + row * 2, m_i, mask=mg)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=mg)


@triton.jit
def _merge_kernel(part_ptr, ml_ptr, o_ptr, NSPLIT: tl.constexpr, NS_P: tl.constexpr, D: tl.constexpr):
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
    tl.store(o_ptr + r * D + d, out.to(o_ptr.dtype.element_ty))


# launch settings of the decode kernel: the best of bench/decode_kernels.py --sweep at B = 64 and 256 on an H100
# (2026-11-24: 6.8 / 22.1 us vs 8.2 / 22.8 us for block_n 64)
DECODE_ATTN = {"block_n": 128, "num_warps": 4, "num_stages": 2}


def paged_decode_attention(q, k_cache, v_cache, block_tables, ctx_lens, block_size, num_splits: int = 1,
                           split_len: torch.Tensor | None = None, block_n: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None):
    """num_splits > 1 (flash-decoding, for batches too small to fill the GPU) cuts each
    context into pieces of `split_len` tokens (a device int32 [1] that the caller keeps at
    >= longest context / num_splits), then merges the partial softmaxes."""
    B, hq, d = q.shape
    hkv = k_cache.shape[1]
    G = hq // hkv
    out = torch.empty_like(q)
    BLOCK_N = block_n or DECODE_ATTN["block_n"]
    launch = dict(num_warps=num_warps or DECODE_ATTN["num_warps"], num_stages=num_stages or DECODE_ATTN["num_stages"])
    consts = dict(HQ=hq, HKV=hkv, G=G, G_P=max(16, triton.next_power_of_2(G)), D=d, BS=block_size, BLOCK_N=BLOCK_N)
    if num_splits == 1:
        _paged_decode_kernel[(B, hkv, 1)](q, k_cache, v_cache, block_tables, ctx_lens, out, out, ctx_lens, d ** -0.5,
                                          k_cache.stride(0), v_cache.stride(0), block_tables.stride(0),
                                          NSPLIT=1, **consts, **launch)
        return out
    part = torch.empty(B * hq * num_splits, d, dtype=torch.float32, device=q.device)
    ml = torch.empty(B * hq * num_splits, 2, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(B, hkv, num_splits)](q, k_cache, v_cache, block_tables, ctx_lens, part, ml, split_len, d ** -0.5,
                                               k_cache.stride(0), v_cache.stride(0), block_tables.stride(0),
                                               NSPLIT=num_splits, **consts, **launch)
    _merge_kernel[(B * hq,)](part, ml, out, NSPLIT=num_splits, NS_P=triton.next_power_of_2(num_splits), D=d, num_warps=1)
    return out


@triton.jit
def _segment_max(logits_ptr, row, stride_l, lo, hi, it, BLOCK: tl.constexpr):
    # pass 1: the segment's largest scaled logit (loads only; the segment is re-read from L2 in pass 2)
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], -float("inf"), tl.float32)
    for start in range(lo, hi, BLOCK):
        cols = start + offs
        x = tl.load(logits_ptr + row * stride_l + cols, mask=cols < hi, other=-float("inf")).to(tl.float32) * it
        m = tl.maximum(m, x)
    return tl.max(m, axis=0)


@triton.jit
def _race_chunk(logits_ptr, row, stride_l, hi, cols, u, it, thr, use_noise, mx, ssum, best, best_i, best_x):
    # exponential race (= Gumbel-max): token = argmax exp(x - mx) / E with E = -log(u) ~ Exp(1), the same
    # order as argmax x - log(-log u) but one transcendental fewer; greedy rows race on exp(x - mx) alone.
    # Lane-wise state; a lane sees its columns in increasing order and keeps its first maximum.
    mk = cols < hi
    x = tl.load(logits_ptr + row * stride_l + cols, mask=mk, other=-float("inf")).to(tl.float32) * it
    e = tl.exp2((x - mx) * 1.4426950408889634)
    ssum += e
    r = tl.where(use_noise, tl.fdiv(e, -tl.log2(u) * 0.6931471805599453, ieee_rounding=False), e)
    r = tl.where(mk & (x >= thr), r, -1.0)
    upd = r > best
    return ssum, tl.where(upd, r, best), tl.where(upd, cols, best_i), tl.where(upd, x, best_x)


@triton.jit
def _sample_kernel(logits_ptr, stride_l, V, seg_len, inv_temp_ptr, noise_ptr, thresh_ptr, seed_ptr, ctr_ptr, part_ptr,
                   tok_ptr, lp_ptr, BLOCK: tl.constexpr, NSEG: tl.constexpr):
    # two passes over a row segment: its max, then sum of exp + the race; one Philox call feeds 4 chunks. The
    # random number of column c depends only on (seed, counter, c), not on the segmentation.
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    it = tl.load(inv_temp_ptr + row)
    use_noise = tl.load(noise_ptr + row) != 0
    thr = tl.load(thresh_ptr + row)
    seed = tl.load(seed_ptr + row)
    ctr = tl.load(ctr_ptr + row).to(tl.int64)
    per_step = tl.cdiv(V, 4 * BLOCK) * BLOCK  # random counters one step of one row uses
    offs = tl.arange(0, BLOCK)
    lo = seg * seg_len
    hi = tl.minimum(V, lo + seg_len)
    mx = tl.maximum(_segment_max(logits_ptr, row, stride_l, lo, hi, it, BLOCK), -1e30)  # finite: empty segments
    ssum = tl.zeros([BLOCK], tl.float32)
    best = tl.full([BLOCK], -1.0, tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    best_x = tl.zeros([BLOCK], tl.float32)
    for start in range(lo, hi, 4 * BLOCK):
        u0, u1, u2, u3 = tl.rand4x(seed, ctr * per_step + start // 4 + offs)
        ssum, best, best_i, best_x = _race_chunk(logits_ptr, row, stride_l, hi, start + offs, u0, it, thr, use_noise,
                                                 mx, ssum, best, best_i, best_x)
        ssum, best, best_i, best_x = _race_chunk(logits_ptr, row, stride_l, hi, start + BLOCK + offs, u1, it, thr,
                                                 use_noise, mx, ssum, best, best_i, best_x)
        ssum, best, best_i, best_x = _race_chunk(logits_ptr, row, stride_l, hi, start + 2 * BLOCK + offs, u2, it, thr,
                                                 use_noise, mx, ssum, best, best_i, best_x)
        ssum, best, best_i, best_x = _race_chunk(logits_ptr, row, stride_l, hi, start + 3 * BLOCK + offs, u3, it, thr,
                                                 use_noise, mx, ssum, best, best_i, best_x)
    total = tl.sum(ssum, axis=0)
    b = tl.max(best, axis=0)
    bi = tl.min(tl.where(best == b, best_i, 2147483647), axis=0)  # ties: the first column, like torch.argmax
    bx = tl.max(tl.where((best == b) & (best_i == bi), best_x, -float("inf")), axis=0)
    if NSEG == 1:
        tl.store(tok_ptr + row, bi.to(tl.int64))
        tl.store(lp_ptr + row, bx - mx - tl.log(total))
    else:  # the race score in the log domain, comparable across segments (greedy: the logit itself, exact)
        p = part_ptr + (row * NSEG + seg) * 5
        tl.store(p, mx)
        tl.store(p + 1, total)
        tl.store(p + 2, tl.where(b < 0, -float("inf"), tl.where(use_noise, mx + tl.log(b), bx)))  # b < 0: all filtered
        tl.store(p + 3, bi.to(tl.float32))  # < 2**24: exact
        tl.store(p + 4, bx)


@triton.jit
def _sample_merge_kernel(part_ptr, tok_ptr, lp_ptr, NSEG: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, NSEG)
    p = part_ptr + (row * NSEG + k) * 5
    m = tl.load(p)
    mx = tl.max(m, axis=0)
    total = tl.sum(tl.load(p + 1) * tl.exp(m - mx), axis=0)
    best = tl.load(p + 2)
    col = tl.load(p + 3)
    b = tl.max(best, axis=0)
    bi = tl.min(tl.where(best == b, col, 3.0e38), axis=0)  # segments hold increasing columns: the first wins ties
    bx = tl.max(tl.where((best == b) & (col == bi), tl.load(p + 4), -float("inf")), axis=0)
    tl.store(tok_ptr + row, bi.to(tl.int64))
    tl.store(lp_ptr + row, bx - mx - tl.log(total))


_SM_COUNT: dict = {}

# programs per SM the sampler aims for (B rows x segments): one program per row left most SMs with two 4-warp programs
# at B = 256, too few warps to hide the loads' latency
SAMPLE_PROGRAMS_PER_SM = 8


def _sm_count(dev) -> int:
    if dev not in _SM_COUNT:
        _SM_COUNT[dev] = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
    return _SM_COUNT[dev]


def sample(logits, inv_temp, noise, thresh, seeds, counters, num_segments: int | None = None):
    """num_segments: programs per row (None: enough for SAMPLE_PROGRAMS_PER_SM programs per SM)."""
    B, V = logits.shape
    tok = torch.empty(B, dtype=torch.long, device=logits.device)
    lp = torch.empty(B, dtype=torch.float32, device=logits.device)
    if not B:
        return tok, lp
    BLOCK = 1024
    if num_segments is None:
        num_segments = triton.cdiv(SAMPLE_PROGRAMS_PER_SM * _sm_count(logits.device), B)
    nseg = min(16, triton.next_power_of_2(max(1, min(num_segments, triton.cdiv(V, 4 * BLOCK)))))
    seg_len = triton.cdiv(triton.cdiv(V, nseg), 4 * BLOCK) * 4 * BLOCK
    part = torch.empty(max(1, B * nseg * 5 if nseg > 1 else 1), dtype=torch.float32, device=logits.device)
    _sample_kernel[(B, nseg)](logits, logits.stride(0), V, seg_len, inv_temp, noise, thresh, seeds, counters, part, tok, lp,
                              BLOCK=BLOCK, NSEG=nseg, num_warps=4)
    if nseg > 1:
        _sample_merge_kernel[(B,)](part, tok, lp, NSEG=nseg, num_warps=1)
    return tok, lp


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


def moe_experts(x, gate_up, down, gates, experts):
    return _ref.moe_experts(x, gate_up, down, gates, experts, grouped=grouped_linear, act=silu_mul)
