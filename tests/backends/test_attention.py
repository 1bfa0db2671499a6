"""polyrl.backends.gqa and polyrl.backends.varlen: the GQA head repeat and the varlen attention wrapper that the
trainers (FSDP, Megatron) and the engine's prefill share, and the FSDP varlen attention that uses them."""

from __future__ import annotations

import pytest
import torch

from polyrl.backends import varlen
from polyrl.backends.gqa import repeat_kv_heads


def test_repeat_kv_heads_equals_repeat_interleave():
    x = torch.randn(9, 2, 16)
    assert torch.equal(repeat_kv_heads(x, 14), x.repeat_interleave(7, dim=1))
    assert torch.equal(repeat_kv_heads(x, 2), x)  # no GQA: the heads as they are


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, is_causal=False, window_size=(-1, -1),
                      enable_gqa=False):
    """What varlen_attn computes, per segment through SDPA (bottom-right causal alignment; segments here are square)."""
    assert is_causal or tuple(window_size) == (-1, 0), "the wrapper must ask for causal attention"
    if not enable_gqa:
        assert k.shape[1] == q.shape[1], "without enable_gqa the kernel needs equal head counts"
    out = []
    for s in range(len(cu_q) - 1):
        a, b = int(cu_q[s]), int(cu_q[s + 1])
        c, d = int(cu_k[s]), int(cu_k[s + 1])
        o = torch.nn.functional.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[c:d].transpose(0, 1),
                                                             v[c:d].transpose(0, 1), is_causal=True, scale=scale,
                                                             enable_gqa=k.shape[1] != q.shape[1])
        out.append(o.transpose(0, 1))
    return torch.cat(out)


@pytest.mark.parametrize("api", ["window_size", "is_causal+enable_gqa"])
def test_varlen_wrapper_speaks_both_api_versions(api, monkeypatch):
    """PyTorch 2.10 / 2.11 take window_size=(-1, 0) and equal head counts; later ones is_causal and enable_gqa. The
    wrapper must ask each for causal attention, and repeat kv heads only where the kernel cannot share them."""
    if api == "window_size":
        def fake(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
            return _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size)
    else:
        def fake(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, is_causal=False, enable_gqa=False):
            assert enable_gqa and k.shape[1] == 2, "kv heads are shared by the kernel, not repeated"
            return _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, is_causal=is_causal,
                                     enable_gqa=enable_gqa)
    varlen._params.cache_clear()
    monkeypatch.setattr(varlen, "_fn", lambda: fake)
    try:
        torch.manual_seed(0)
        lens = [3, 7, 5]
        cu = torch.tensor([0, 3, 10, 15], dtype=torch.int32)
        q, k, v = torch.randn(15, 6, 8, dtype=torch.float64), torch.randn(15, 2, 8, dtype=torch.float64), torch.randn(15, 2, 8, dtype=torch.float64)
        out = varlen.causal(q, k, v, cu, cu, max(lens), max(lens), scale=0.3)
        want = _reference_varlen(q, k, v, cu, cu, 7, 7, scale=0.3, is_causal=True, enable_gqa=True)
        torch.testing.assert_close(out, want, rtol=0, atol=0)  # same SDPA arithmetic; a kv head repeat copies values exactly
        assert varlen.shares_kv_heads() == (api != "window_size")
    finally:
        varlen._params.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gqa_varlen_attention_does_not_sync_the_host():
    """The varlen forward of a GQA layer runs without a device-to-host sync (repeat_interleave(int) on CUDA reads its
    output size back: one stall per layer per forward), and equals SDPA per sequence."""
    from polyrl.backends.fsdp.attention import _varlen_forward, available
    if not available():
        pytest.skip("torch.nn.attention.varlen is not available")
    g = torch.Generator(device="cuda").manual_seed(0)
    lens = [30, 34]
    q = torch.randn(1, 14, sum(lens), 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, 2, sum(lens), 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _ = _varlen_forward(None, q, k, v, None, scaling=0.125, cu_seq_lens_q=cu, max_length_q=max(lens))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        want = torch.nn.functional.scaled_dot_product_attention(q[..., sl, :], k[..., sl, :], v[..., sl, :], is_causal=True,
                                                                scale=0.125, enable_gqa=True)
        torch.testing.assert_close(out[0, sl], want[0].transpose(0, 1), atol=2e-2, rtol=0)  # BF16: both kernels round
        start += n
