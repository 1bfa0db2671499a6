"""Per-token log-probs (and entropy) of the targets from hidden states and the LM head, without a [T, V] logits tensor.

`chunked_logprobs` is one autograd function over the whole [T, H] hidden block, in chunks of `chunk_size` tokens:

- forward, per chunk: logits = h @ W^T in the model's dtype (as an HF forward rounds them), then one pass over the
  logits for each row's log-sum-exp (and, with entropy, sum p * z); the target's logit is a gather. Saved for
  backward: h, W, the targets and the per-token lse (and entropy): 4-8 bytes per token, no logits.
- backward, per chunk: the logits again (one GEMM), then one pass that overwrites them with d loss / d logits
  (g * (onehot - p), plus the entropy term), and the two GEMMs for dh and dW.

Against the obvious version (a checkpointed chunk under autograd), the backward re-runs neither the softmax pass nor
the gather's scatter into a zero [chunk, V] FP32 tensor, and d logits is written once, in place, in the model's
dtype: at the 0.5B shape (V = 151936) this was ~30% of the GPU time of a GRPO train phase.

On CUDA with Triton the two passes are Triton kernels (`_row_stats_triton`, `_grad_logits_triton`); elsewhere the
same arithmetic in torch ops, which is their reference (tests/backends/test_logprobs.py).
"""

from __future__ import annotations

import functools

import torch


# ---- torch reference of the two passes (CPU, and CUDA without Triton) ----------------------------------------------
def _row_stats_torch(logits: torch.Tensor, inv_temp: float, with_entropy: bool):
    """[c, V] logits -> lse [c] (fp32) and entropy [c] | None of softmax(logits * inv_temp)."""
    z = logits.float()
    if inv_temp != 1.0:
        z = z * inv_temp
    lse = torch.logsumexp(z, dim=-1)
    if not with_entropy:
        return lse, None
    return lse, lse - (torch.softmax(z, dim=-1) * z).sum(-1)


def _grad_logits_torch(logits: torch.Tensor, targets, lse, ent, g_lp, g_ent, inv_temp: float) -> torch.Tensor:
    """d loss / d logits for one chunk (written over `logits`): with z = logits * inv_temp and p = softmax(z),
    d logp_t / d z = onehot(t) - p and d H / d z = -p * (z - lse + H)."""
    z = logits.float()
    if inv_temp != 1.0:
        z = z * inv_temp
    p = torch.exp(z - lse[:, None])
    gz = p * (-g_lp[:, None])
    gz.scatter_add_(1, targets[:, None], g_lp[:, None])
    if ent is not None:
        gz -= g_ent[:, None] * p * (z - lse[:, None] + ent[:, None])
    if inv_temp != 1.0:
        gz *= inv_temp
    return logits.copy_(gz)


# ---- Triton (CUDA) ------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _triton_kernels():
    """The two kernels, compiled on first use; None when Triton is not installed."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def row_stats(x_ptr, stride, m_ptr, s_ptr, t_ptr, V, seg, n_split, inv_temp, ENT: tl.constexpr, BLOCK: tl.constexpr):
        # one program: one row's segment [sp * seg, (sp + 1) * seg) of the vocabulary; running max m, sum of
        # exp(z - m) s and (entropy) sum of exp(z - m) * z t, combined across segments on the host side in torch
        row = tl.program_id(0).to(tl.int64)
        sp = tl.program_id(1)
        lo = sp * seg
        hi = tl.minimum(lo + seg, V)
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        t = tl.zeros((), tl.float32)
        for off in range(lo, hi, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            ok = cols < hi
            z = tl.load(x_ptr + row * stride + cols, mask=ok, other=float("-inf")).to(tl.float32) * inv_temp
            m_new = tl.maximum(m, tl.max(z, axis=0))
            scale = tl.exp(m - m_new)
            e = tl.where(ok, tl.exp(z - m_new), 0.0)
            s = s * scale + tl.sum(e, axis=0)
            if ENT:
                t = t * scale + tl.sum(e * tl.where(ok, z, 0.0), axis=0)
            m = m_new
        out = row * n_split + sp
        tl.store(m_ptr + out, m)
        tl.store(s_ptr + out, s)
        if ENT:
            tl.store(t_ptr + out, t)

    @triton.jit
    def grad_logits(x_ptr, stride, tgt_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, V, inv_temp, ENT: tl.constexpr,
                    BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < V
        ptr = x_ptr + row * stride + cols
        z = tl.load(ptr, mask=ok, other=0.0).to(tl.float32) * inv_temp
        lse = tl.load(lse_ptr + row)
        g = tl.load(glp_ptr + row)
        tgt = tl.load(tgt_ptr + row)
        p = tl.exp(z - lse)
        gz = g * (tl.where(cols == tgt, 1.0, 0.0) - p)
        if ENT:
            gz -= tl.load(gent_ptr + row) * p * (z - lse + tl.load(ent_ptr + row))
        tl.store(ptr, (gz * inv_temp).to(x_ptr.dtype.element_ty), mask=ok)

    return triton, row_stats, grad_logits


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and _triton_kernels() is not None


def _row_stats_triton(logits: torch.Tensor, inv_temp: float, with_entropy: bool):
    triton, row_stats, _ = _triton_kernels()
    c, V = logits.shape
    block = 2048
    sms = torch.cuda.get_device_properties(logits.device).multi_processor_count
    n_split = max(1, min(triton.cdiv(V, 8 * block), triton.cdiv(8 * sms, max(c, 1))))  # >= ~8 programs per SM
    seg = triton.cdiv(triton.cdiv(V, n_split), block) * block
    n_split = triton.cdiv(V, seg)
    part = torch.empty(3 if with_entropy else 2, c, n_split, dtype=torch.float32, device=logits.device)
    if c:
        row_stats[(c, n_split)](logits, logits.stride(0), part[0], part[1], part[-1], V, seg, n_split, inv_temp,
                                ENT=with_entropy, BLOCK=block, num_warps=8)
    m = part[0].amax(1)
    w = torch.exp(part[0] - m[:, None])
    s = (part[1] * w).sum(1)
    lse = m + torch.log(s)
    if not with_entropy:
        return lse, None
    return lse, lse - (part[2] * w).sum(1) / s


def _grad_logits_triton(logits, targets, lse, ent, g_lp, g_ent, inv_temp: float) -> torch.Tensor:
    triton, _, grad_logits = _triton_kernels()
    c, V = logits.shape
    block = 4096
    if c:
        ent_ = ent if ent is not None else lse
        grad_logits[(c, triton.cdiv(V, block))](logits, logits.stride(0), targets, lse, ent_, g_lp,
                                                g_ent if g_ent is not None else g_lp, V, inv_temp,
                                                ENT=ent is not None, BLOCK=block, num_warps=8)
    return logits


def _row_stats(logits, inv_temp, with_entropy):
    return (_row_stats_triton if _use_triton(logits) else _row_stats_torch)(logits, inv_temp, with_entropy)


def _grad_logits(logits, targets, lse, ent, g_lp, g_ent, inv_temp):
    return (_grad_logits_triton if _use_triton(logits) else _grad_logits_torch)(logits, targets, lse, ent, g_lp, g_ent,
                                                                                inv_temp)


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temp: float, with_entropy: bool, chunk: int):
        T = hidden.shape[0]
        lse = torch.empty(T, dtype=torch.float32, device=hidden.device)
        logp = torch.empty(T, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(T, dtype=torch.float32, device=hidden.device) if with_entropy else None
        for s in range(0, T, chunk):
            logits = hidden[s:s + chunk] @ weight.t()
            lse_c, ent_c = _row_stats(logits, inv_temp, with_entropy)
            lse[s:s + chunk] = lse_c
            logp[s:s + chunk] = logits.gather(1, targets[s:s + chunk, None]).squeeze(1).float() * inv_temp - lse_c
            if with_entropy:
                ent[s:s + chunk] = ent_c
            del logits
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.inv_temp, ctx.chunk = inv_temp, chunk
        ctx.set_materialize_grads(False)  # an unused output (the entropy) gets None, not a zero tensor to multiply
        return logp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        T, chunk = hidden.shape[0], ctx.chunk
        if g_lp is None:  # only the entropy is differentiated
            g_lp = torch.zeros(T, dtype=torch.float32, device=hidden.device)
        g_lp = g_lp.float().contiguous()
        use_ent = ent is not None and g_ent is not None
        g_ent = g_ent.float().contiguous() if use_ent else None
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        for s in range(0, T, chunk):
            e = min(s + chunk, T)
            h = hidden[s:e]
            logits = h @ weight.t()
            d = _grad_logits(logits, targets[s:e], lse[s:e], ent[s:e] if use_ent else None, g_lp[s:e],
                             g_ent[s:e] if use_ent else None, ctx.inv_temp)  # in place over the logits
            if need_h:
                torch.mm(d, weight, out=grad_h[s:e])
            if need_w:
                grad_w.addmm_(d.t(), h)
            del logits, d
        return grad_h, grad_w, None, None, None, None


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                     chunk_size: int = 1024, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden: [T, H], weight: [V, H] (the LM head), targets: [T] -> logprobs [T] (fp32), entropy [T] | None."""
    inv_temp = 1.0 / temperature if temperature > 0 else 1.0
    return _ChunkedLogprobs.apply(hidden, weight, targets.long(), inv_temp, with_entropy, max(1, int(chunk_size)))


def reference_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                       with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same quantities through plain autograd over full [T, V] logits: what tests compare against."""
    inv_temp = 1.0 / temperature if temperature > 0 else 1.0
    z = (hidden @ weight.t()).float() * inv_temp
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return logp, None
    return logp, lse - (torch.softmax(z, dim=-1) * z).sum(-1)
