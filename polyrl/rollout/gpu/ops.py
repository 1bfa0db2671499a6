"""The engine's per-layer operations, in plain torch. These run anywhere (the CPU tests use
them) and are the reference the Triton kernels in `triton_ops.py` are checked against.

Rounding follows transformers' Llama/Qwen modules step for step (fp32 statistics, a cast to
the model dtype, then the weight product in the model dtype), so BF16 results stay close to
what the trainer recomputes.

Shapes: T tokens (packed, no padding), H hidden, Hq / Hkv query / key-value heads, D head
dim, S cache slots (num_blocks * block_size). A KV cache of one layer is [S, Hkv, D]; slot
s lives in block s // block_size.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from polyrl.backends import varlen
from polyrl.backends.gqa import repeat_kv_heads


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, H] -> (rmsnorm(residual + x) [T, H], residual + x [T, H])."""
    s = x if residual is None else residual + x
    h = s.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(s.dtype), s


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_store(qkv: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int, d: int,
               q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6,
               write_k: bool = True, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv: [T, (Hq + 2 Hkv) D]; pos, slots: [T]; cos, sin: [max_pos, D / 2] in the model dtype.
    Applies the optional per-head q/k RMSNorm (Qwen3) and rotary embedding, writes k and v
    into the cache at `slots`, and returns q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D].
    k_scale, v_scale [S, Hkv] (an FP8 cache, kv_cache.KVCache): k and v are stored as E4M3 with one scale per token
    and head (quantize_heads); the returned k and v are the unrounded ones (prefill attends to those)."""
    T = qkv.shape[0]
    q = qkv[:, :hq * d].view(T, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(T, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(T, hkv, d)
    if q_norm is not None:
        q, k = _rms(q, q_norm, eps), _rms(k, k_norm, eps)
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]

    def rot(x):  # (x * cos) + (rotate_half(x) * sin), each product rounded like HF
        x1, x2 = x[..., :d // 2], x[..., d // 2:]
        return torch.cat([x1 * c + (-x2) * s, x2 * c + x1 * s], dim=-1)

    q, k = rot(q), rot(k)
    if k_scale is None:
        k_cache[slots] = k
        v_cache[slots] = v
    else:
        k_cache[slots], k_scale[slots] = quantize_heads(k)
        v_cache[slots], v_scale[slots] = quantize_heads(v)
    return q, k, v


def quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H, D] -> (E4M3 [T, H, D], float32 scales [T, H]): each head vector is one 1 x D block of the weight
    stream's quantizer (its largest |x| onto 448, an all-zero vector scale 1, rounded to nearest even); x ~= q * scale."""
    from polyrl.weight_sync.quantize import quantize_fp8_block
    q, sc = quantize_fp8_block(x, block=(1, x.shape[-1]))
    return q, sc.squeeze(-1)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu: [T, 2 I] (gate | up) -> silu(gate) * up [T, I]."""
    i = gu.shape[-1] // 2
    return F.silu(gu[:, :i]) * gu[:, i:]


def moe_route(x: torch.Tensor, router: torch.Tensor, top_k: int, normalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H]; router: [E, H] -> (gates [T, k] in the model dtype, experts [T, k] int64), as
    Qwen3MoeTopKRouter computes them: logits in the model dtype, softmax and top-k in fp32,
    renormalised over the k when `normalise`."""
    probs = torch.softmax(F.linear(x, router), dim=-1, dtype=torch.float32)
    gates, experts = torch.topk(probs, top_k, dim=-1)
    if normalise:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return gates.to(x.dtype), experts


def moe_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, gates: torch.Tensor, experts: torch.Tensor,
                grouped=None, act=None, scales: tuple | None = None) -> torch.Tensor:
    """x: [T, H]; gate_up: [E, 2I, H]; down: [E, H, I]; gates, experts: [T, k] -> [T, H] =
    sum over the k of gate * down_e(silu(gate_e x) * up_e x).
    The T * k (token, expert) pairs are sorted by expert, so each expert's rows are one
    contiguous block (ends `offs` [E]) and two grouped matmuls do every expert; the k results
    of a token are summed after putting the rows back in order (no atomics: deterministic).
    Only shape-static ops outside `grouped` (sort, searchsorted, gathers), so this is CUDA-graph
    safe when `grouped` is. grouped(x_rows [S, K], w [E, N, K], offs [E] int32) -> [S, N]
    (default: grouped_linear below); act: the SiLU * up (default: silu_mul).
    scales: FP8 experts (gate_up, down float8_e4m3fn; polyrl.rollout.gpu.fp8): (gate_up's scales, their row_div,
    down's scales, their row_div). Without `grouped` both are dequantized to x's dtype first, the CPU emulation's
    weights (as fp8_linear does); a given `grouped` then takes (x_rows, w, offs, scale, row_div)."""
    act = act or silu_mul
    if scales is not None and grouped is None:
        from polyrl.rollout.gpu.fp8 import dequantize
        gate_up, down = dequantize(gate_up, scales[0], scales[1], x.dtype), dequantize(down, scales[2], scales[3], x.dtype)
        scales = None
    grouped = grouped or grouped_linear
    T, k = experts.shape
    order_e, perm = torch.sort(experts.reshape(-1))
    offs = torch.searchsorted(order_e, torch.arange(1, gate_up.shape[0] + 1, device=x.device, dtype=order_e.dtype),
                              out_int32=True)
    rows = x.index_select(0, perm // k)
    if scales is None:
        y = grouped(act(grouped(rows, gate_up, offs)), down, offs)  # [T * k, H]
    else:
        y = grouped(act(grouped(rows, gate_up, offs, *scales[:2])), down, offs, *scales[2:])
    y = y * gates.reshape(-1).index_select(0, perm)[:, None]
    out = torch.empty_like(y).index_copy_(0, perm, y)
    return out.view(T, k, -1).sum(dim=1)  # one rounding of the k-term sum, like transformers' grouped_mm experts


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x: [S, K] rows grouped by expert (group e is rows [offs[e-1], offs[e])); w: [E, N, K] ->
    [S, N], row r times w[its group]^T. One matmul per non-empty group; reads `offs` on the
    host (the reference, and the engine's path on CPU and for eager prefill)."""
    out = x.new_empty(x.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = F.linear(x[start:end], w[e])
        start = end
    return out


def prefill_index(lens: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of every packed token in the right-padded [len(lens), max(lens)] layout, built on the host and
    moved once per prefill: built per layer on the device, the lengths' host-to-device copy and repeat_interleave's
    size read-back stalled the stream twice in every layer."""
    lens_t = torch.tensor(lens)
    row = torch.repeat_interleave(torch.arange(len(lens)), lens_t)
    col = torch.arange(int(lens_t.sum())) - (torch.cumsum(lens_t, 0) - lens_t)[row]
    return row.to(device), col.to(device)


def prefill_cu_seqlens(lens: list[int], device) -> torch.Tensor:
    """int32 [len(lens) + 1] boundaries of the packed sequences, for the varlen kernel (built on the host, moved once
    per prefill)."""
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32).to(device)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int],
                      index: tuple[torch.Tensor, torch.Tensor] | None = None,
                      cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention within each of the packed sequences (no cached prefix).
    q: [T, Hq, D], k, v: [T, Hkv, D], lens: the sequences' lengths (sum T) -> [T, Hq, D].
    With cu_seqlens (prefill_cu_seqlens(lens); only where varlen.usable): one varlen flash call over the packed tokens.
    Otherwise the sequences are right-padded to the longest one and run through SDPA: under a causal
    mask, a real query only sees real keys, so padding never leaks in. index: prefill_index(lens), if built already."""
    if cu_seqlens is not None:
        return varlen.causal(q, k, v, cu_seqlens, cu_seqlens, max(lens), max(lens))
    T, hq, d = q.shape
    hkv = k.shape[1]
    if hkv != hq:  # GQA: repeat the kv heads (prefill is compute-light; keeps every SDPA backend usable), without a sync
        k, v = repeat_kv_heads(k, hq), repeat_kv_heads(v, hq)
    B, L = len(lens), max(lens)
    if B == 1:
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           is_causal=True)
        return o[0].transpose(0, 1)
    if all(n == L for n in lens):
        shape = (B, L, hq, d)
        o = F.scaled_dot_product_attention(q.reshape(shape).transpose(1, 2), k.reshape(shape).transpose(1, 2),
                                           v.reshape(shape).transpose(1, 2), is_causal=True)
        return o.transpose(1, 2).reshape(T, hq, d)
    row, col = index if index is not None else prefill_index(lens, q.device)

    def pad(x):
        out = x.new_zeros(B, L, hq, d)
        out[row, col] = x
        return out.transpose(1, 2)

    o = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), is_causal=True)
    return o.transpose(1, 2)[row, col]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           ctx_lens: torch.Tensor, block_size: int, num_splits: int = 1, split_len=None,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence against its paged cache.
    q: [B, Hq, D]; k_cache, v_cache: [S, Hkv, D]; block_tables: [B, W] (int); ctx_lens: [B]
    (tokens in the cache, the current one included) -> [B, Hq, D]. (The split arguments
    are the Triton kernel's; they do not change the result.) k_scale, v_scale [S, Hkv]: an FP8
    cache, dequantized here (q * scale in fp32)."""
    B, hq, d = q.shape
    hkv = k_cache.shape[1]
    L = int(ctx_lens.max())
    pos = torch.arange(L, device=q.device)
    slots = block_tables[:, pos // block_size].long() * block_size + pos % block_size  # [B, L]
    past = pos[None, :] >= ctx_lens[:, None]  # [B, L]: slots past the row's context hold anything (NaN included:
    # the cache is never cleared), so their values are zeroed, not only their scores masked (0 * NaN is NaN)
    k, v = k_cache[slots].float(), v_cache[slots].float()  # [B, L, Hkv, D]
    if k_scale is not None:
        k, v = k * k_scale[slots][..., None], v * v_scale[slots][..., None]
    v = v.masked_fill(past[:, :, None, None], 0.0)
    g = hq // hkv
    qf = q.float().view(B, hkv, g, d)
    scores = torch.einsum("bhgd,blhd->bhgl", qf, k) / math.sqrt(d)
    scores = scores.masked_fill(past[:, None, None, :], float("-inf"))
    o = torch.einsum("bhgl,blhd->bhgd", torch.softmax(scores, -1), v)
    return o.reshape(B, hq, d).to(q.dtype)


def sample(logits: torch.Tensor, inv_temp: torch.Tensor, noise: torch.Tensor, thresh: torch.Tensor, seeds: torch.Tensor,
           counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gumbel-max sampling, one seeded random stream per row. logits: [B, V]; inv_temp,
    thresh: [B] fp32; noise: [B] (0 = greedy); seeds, counters: [B] int64 ->
    tokens [B] int64, logprobs [B] fp32 of the token under softmax(logits * inv_temp)
    (unfiltered). Tokens whose scaled logit is below `thresh` (top-k / top-p) are never
    drawn, which samples the renormalized filtered distribution exactly."""
    x = logits.float() * inv_temp[:, None]
    lse = torch.logsumexp(x, -1)
    score = x.clone()
    for r in torch.nonzero(noise).flatten().tolist():
        g = torch.Generator(device=x.device)
        g.manual_seed((int(seeds[r]) * 1_000_003 + int(counters[r])) % (2**63))
        u = torch.rand(x.shape[-1], generator=g, device=x.device)
        score[r] += -torch.log(-torch.log(u))
    score = score.masked_fill(x < thresh[:, None], float("-inf"))
    tokens = score.argmax(-1)
    return tokens, x.gather(-1, tokens[:, None]).squeeze(-1) - lse


def filter_thresholds(logits: torch.Tensor, inv_temp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Per-row lowest scaled logit that top-k / top-p keep, as polyrl.rollout.sampling
    defines them (top-k first, then top-p on what remains; the token that crosses p is
    kept). logits: [B, V] -> [B] fp32; -inf when nothing is filtered."""
    x = logits.float() * inv_temp[:, None]
    thr = torch.full((x.shape[0],), float("-inf"), device=x.device)
    if 0 < top_k < x.shape[-1]:
        thr = torch.topk(x, top_k, dim=-1).values[:, -1]
    if top_p < 1.0:
        xs = torch.sort(x.masked_fill(x < thr[:, None], float("-inf")), descending=True, dim=-1).values
        p = torch.softmax(xs, -1)
        keep = (p.cumsum(-1) - p) <= top_p
        n_keep = keep.sum(-1).clamp(min=1)
        thr = torch.maximum(thr, xs.gather(-1, (n_keep - 1)[:, None]).squeeze(-1))
    return thr


def fp8_activations(M: int, dtype: torch.dtype) -> bool:
    """The reference ops take FP8 linears' activations in the model dtype (weights-only emulation), never quantized."""
    return False


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
               row_div: int = 128) -> torch.Tensor:
    """x: [T, K] in the model dtype; w: float8_e4m3fn [N, K]; scale: its block scales (polyrl.rollout.gpu.fp8) ->
    F.linear(x, dequantized w cast to x's dtype, bias): the CPU emulation's numerics (the weights dequantized in
    fp32, rounded to the model dtype, then an ordinary matmul), which the Triton kernel reproduces."""
    from polyrl.rollout.gpu.fp8 import dequantize
    return F.linear(x, dequantize(w, scale, row_div, x.dtype), bias)
