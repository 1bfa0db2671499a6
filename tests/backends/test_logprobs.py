"""chunked_logprobs (one autograd function: lse saved, the backward writes d logits in place) against plain autograd
over full logits, on CPU; on CUDA the Triton passes against the torch ones."""

import pytest
import torch

from polyrl.backends.logprobs import (_grad_logits_torch, _row_stats_torch, _use_triton, chunked_logprobs,
                                      reference_logprobs)


def _inputs(T=11, H=16, V=97, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(T, H, generator=g) * 2).to(device=device, dtype=dtype).requires_grad_()
    w = torch.randn(V, H, generator=g).to(device=device, dtype=dtype).requires_grad_()
    t = torch.randint(0, V, (T,), generator=g).to(device)
    a = torch.randn(T, generator=g).to(device)  # per-token upstream grads, like a GRPO loss's advantages
    b = torch.randn(T, generator=g).to(device)
    return h, w, t, a, b


def _run(fn, h, w, t, a, b, **kw):
    h_, w_ = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    lp, ent = fn(h_, w_, t, **kw)
    loss = (lp * a).sum() + ((ent * b).sum() if ent is not None else 0.0)
    loss.backward()
    return lp.detach(), (ent.detach() if ent is not None else None), h_.grad, w_.grad


@pytest.mark.parametrize("chunk", [1, 4, 11, 64])
@pytest.mark.parametrize("temperature,with_entropy", [(1.0, False), (0.7, True), (1.3, True)])
def test_chunked_equals_full_logits_autograd(chunk, temperature, with_entropy):
    # float64 inputs: both sides round the logits to fp32 and reduce V = 97 terms in fp32 (relative error ~V * 6e-8 of
    # the largest term, |z| < ~30 here), so 1e-4 absolute on values and on grads (sums of T products of such terms)
    # is far above the arithmetic's error and far below any mistake in the formulas
    h, w, t, a, b = _inputs(dtype=torch.float64)
    ref = _run(reference_logprobs, h, w, t, a, b, temperature=temperature, with_entropy=with_entropy)
    got = _run(chunked_logprobs, h, w, t, a, b, temperature=temperature, with_entropy=with_entropy, chunk_size=chunk)
    for r, g in zip(ref, got):
        if r is None:
            assert g is None
            continue
        torch.testing.assert_close(g.double(), r.double(), atol=1e-4, rtol=1e-4)


def test_only_logprobs_differentiated_while_entropy_is_returned():
    # GRPO computes the entropy as a metric and differentiates the log-probs only: the entropy's grad is None then
    h, w, t, a, b = _inputs(dtype=torch.float64)
    lp_r, _ = reference_logprobs(h, w, t)
    (lp_r * a).sum().backward()
    hr, wr = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    lp, ent = chunked_logprobs(h, w, t, with_entropy=True, chunk_size=4)
    assert ent is not None and ent.shape == lp.shape
    (lp * a).sum().backward()
    torch.testing.assert_close(h.grad, hr, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(w.grad, wr, atol=1e-4, rtol=1e-4)


def test_no_grad_and_frozen_head():
    h, w, t, a, _ = _inputs()
    with torch.no_grad():
        lp, _ = chunked_logprobs(h, w, t, chunk_size=3)
    ref, _ = reference_logprobs(h.detach(), w.detach(), t)
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=1e-5)  # fp32 logsumexp over 97 terms: ~1e-6
    w2 = w.detach()  # LoRA: the head does not train, only the hidden states get a grad
    lp, _ = chunked_logprobs(h, w2, t, chunk_size=3)
    (lp * a).sum().backward()
    assert h.grad is not None and torch.isfinite(h.grad).all()


def test_empty_input():
    h, w, t, _, _ = _inputs(T=0)
    lp, ent = chunked_logprobs(h, w, t, with_entropy=True)
    assert lp.shape == (0,) and ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert h.grad.shape == h.shape and float(w.grad.abs().sum()) == 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton passes)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_passes_match_the_torch_passes(dtype):
    # a real vocabulary width (Qwen2's 151936: several segments of the split row reduction) and odd row counts
    torch.manual_seed(0)
    c, V = 37, 151936
    logits = (torch.randn(c, V, device="cuda") * 4).to(dtype)
    assert _use_triton(logits)
    from polyrl.backends.logprobs import _grad_logits_triton, _row_stats_triton
    for inv_temp in (1.0, 1 / 0.7):
        lse_t, ent_t = _row_stats_triton(logits, inv_temp, True)
        lse_r, ent_r = _row_stats_torch(logits, inv_temp, True)
        # fp32 sums of 151936 terms in a different order: relative ~1e-5 at worst
        torch.testing.assert_close(lse_t, lse_r, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(ent_t, ent_r, atol=1e-3, rtol=1e-4)
        tgt = torch.randint(0, V, (c,), device="cuda")
        g_lp, g_ent = torch.randn(c, device="cuda"), torch.randn(c, device="cuda")
        for e, ge in ((ent_r, g_ent), (None, None)):
            dt = _grad_logits_triton(logits.clone(), tgt, lse_r, e, g_lp, ge, inv_temp)
            dr = _grad_logits_torch(logits.clone(), tgt, lse_r, e, g_lp, ge, inv_temp)
            # same fp32 formula per element, one rounding to `dtype` at the end (exp may differ in the last ulp)
            tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(dt.float(), dr.float(), atol=tol * float(g_lp.abs().max()), rtol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_chunked_equals_full_logits_autograd_in_fp32():
    h, w, t, a, b = _inputs(T=300, H=64, V=151936 // 8, device="cuda")
    ref = _run(reference_logprobs, h, w, t, a, b, temperature=0.8, with_entropy=True)
    got = _run(chunked_logprobs, h, w, t, a, b, temperature=0.8, with_entropy=True, chunk_size=128)
    for r, g in zip(ref, got):
        # TF32 is off by default for matmuls in torch; fp32 reductions over 19k terms in two orders: ~1e-5 relative
        torch.testing.assert_close(g, r, atol=2e-4, rtol=1e-4)
