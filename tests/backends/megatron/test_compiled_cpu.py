"""--compile on the Megatron backend, CPU half (megatron-core not needed): polyrl's compiled RMSNorm and q/k RoPE
(polyrl/backends/megatron/compiled.py) compute the eager functions' values and gradients, and a new token count or
the other stride of the hidden states' size-1 batch dim reuses the graph instead of recompiling. The GPU parity
tests (tests/backends/megatron/test_megatron_gpu.py) run the whole model with it on."""

from __future__ import annotations

import torch
import torch._dynamo

from polyrl.backends.megatron import compiled, thd

# FP32 on both sides: the compiled kernels sum the H squares of a row in another order (relative error ~H x 2^-24
# ~ 1e-5 at worst for H = 64); 1e-5 + 1e-5 relative is far below any formula error (a missing eps, weight or cast)
TOL = dict(atol=1e-5, rtol=1e-5)


def _grads(fn, *inputs):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(1)
    sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs).backward()
    return [o.detach() for o in outs], [t.grad for t in leaves]


def test_compiled_norm_and_rope_equal_eager_and_compile_once_per_width():
    torch._dynamo.reset()
    torch.manual_seed(0)
    H = 64
    w = 1.0 + 0.2 * torch.randn(H)
    with torch._dynamo.config.patch(error_on_recompile=False):
        for zero_centered in (False, True):
            x = torch.randn(11, 1, H)
            want = _grads(lambda a, b: compiled.rms_norm(a, b, 1e-6, zero_centered), x, w)
            got = _grads(lambda a, b: compiled.compiled_rms_norm(a, b, 1e-6, zero_centered), x, w)
            for a, b in zip(want[0] + want[1], got[0] + got[1]):
                torch.testing.assert_close(b, a, **TOL)
        q, k = torch.randn(11, 4, 16), torch.randn(11, 2, 16)
        cos, sin = torch.randn(11, 1, 12), torch.randn(11, 1, 12)  # partial rotary: 12 of 16 channels
        want = _grads(compiled.rope_qk, q, k, cos, sin)
        got = _grads(compiled.compiled_rope_qk, q, k, cos, sin)
        for a, b in zip(want[0] + want[1], got[0] + got[1]):
            torch.testing.assert_close(b, a, **TOL)
    # every micro-batch has its own length, and megatron hands the norms [T, 1, H] with either stride on the size-1 dim:
    # none of that may compile again
    w = w.requires_grad_(True)  # as in training (the first calls above saw a weight that needs its gradient)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for T in (5, 29, 64):
            x = torch.randn(T, 1, H, requires_grad=True)
            compiled.compiled_rms_norm(x, w, 1e-6, False).sum().backward()
            xt = torch.randn(1, T, H).transpose(0, 1).requires_grad_(True)
            compiled.compiled_rms_norm(xt, w, 1e-6, False).sum().backward()
            c, s = torch.randn(T, 1, 12, requires_grad=True), torch.randn(T, 1, 12, requires_grad=True)
            qq, kk = compiled.compiled_rope_qk(torch.randn(T, 4, 16, requires_grad=True),
                                               torch.randn(T, 2, 16, requires_grad=True), c, s)
            (qq.sum() + kk.sum()).backward()
    assert torch.equal(thd.apply_rope(q, cos, sin)[..., 12:], q[..., 12:])  # the channels past r are left alone
