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


@pytest.mark.parametrize("api,version,max_q", [("window_size", "2.10.0", 7), ("window_size", "2.11.0", 7),
                                               ("window_size", "2.11.0", 1), ("is_causal+enable_gqa", "2.13.0", 7),
                                               ("is_causal+enable_gqa", "2.13.0", 1)])
def test_varlen_wrapper_speaks_both_api_versions(api, version, max_q, monkeypatch):
    """PyTorch 2.10 / 2.11 take window_size=(-1, 0), later ones is_causal and enable_gqa; from 2.11 the kernel shares
    kv heads itself (2.10 is not known to: it gets them repeated). The wrapper must ask each for causal attention,
    and repeat kv heads where the kernel cannot share them or where every sequence has one query row (FlashAttention
    then folds a kv head's query heads into one program's rows: another kernel specialisation)."""
    shares = version >= "2.11" and max_q > 1
    seen = []
    if api == "window_size":
        def fake(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
            seen.append(k.shape[1])
            return _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size,
                                     enable_gqa=k.shape[1] != q.shape[1])
    else:
        def fake(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, is_causal=False, enable_gqa=False):
            seen.append(k.shape[1])
            assert enable_gqa == (k.shape[1] != q.shape[1]), "fewer kv heads go with enable_gqa"
            return _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, is_causal=is_causal,
                                     enable_gqa=enable_gqa)
    monkeypatch.setattr(varlen, "_fn", lambda: fake)
    monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion(version))
    varlen._params.cache_clear()
    varlen.shares_kv_heads.cache_clear()
    try:
        torch.manual_seed(0)
        lens = [3, 7, 5] if max_q > 1 else [1, 1, 1]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        T = sum(lens)
        q, k, v = (torch.randn(T, h, 8, dtype=torch.float64) for h in (6, 2, 2))
        out = varlen.causal(q, k, v, cu, cu, max(lens), max(lens), scale=0.3)
        want = _reference_varlen(q, k, v, cu, cu, max(lens), max(lens), scale=0.3, is_causal=True, enable_gqa=True)
        torch.testing.assert_close(out, want, rtol=0, atol=0)  # same SDPA arithmetic; a kv head repeat copies values exactly
        assert seen == [2 if shares else 6]
        assert varlen.shares_kv_heads() == (version >= "2.11")
    finally:
        varlen._params.cache_clear()
        varlen.shares_kv_heads.cache_clear()


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_shared_kv_heads_give_the_repeated_heads_bits(monkeypatch):
    """Where the kernel shares kv heads itself (varlen.shares_kv_heads), each query head's program reads its group's
    kv head, so the output and dk / dv are the repeated-head call's bit for bit: square packs (the trainers'), fewer
    queries than keys (the shared-prompt scorer's and context parallelism's layout) and one query row per sequence
    (which repeats). dq is only close: FlashAttention's backward adds each key block's share of dq atomically, in an
    order that varies from run to run, so the two FP32 sums may round to neighbouring BF16 values: one BF16 ulp of
    the largest entry (at most 2^-7 of it), twice that allowed."""
    if not varlen.available():
        pytest.skip("torch.nn.attention.varlen is not available")
    if not varlen.shares_kv_heads():
        pytest.skip("this PyTorch's varlen_attn repeats kv heads")
    g = torch.Generator(device="cuda").manual_seed(0)
    lens_k = [40, 296, 7, 129]
    for hq, hkv, d in ((14, 2, 64), (12, 2, 128)):
        for lens_q in (lens_k, [n - p for n, p in zip(lens_k, (39, 40, 0, 100))], [1, 1, 1, 1]):
            cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                          for x in (lens_q, lens_k))
            q0 = torch.randn(sum(lens_q), hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
            k0, v0 = (torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
            go = torch.randn_like(q0)

            def run(share: bool):
                monkeypatch.setattr(varlen, "shares_kv_heads", lambda: share)
                q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
                out = varlen.causal(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), scale=d ** -0.5)
                out.backward(go)
                return out, q.grad, k.grad, v.grad

            shared, repeated = run(True), run(False)
            assert torch.equal(shared[0], repeated[0]), (hq, lens_q)
            assert torch.equal(shared[2], repeated[2]) and torch.equal(shared[3], repeated[3]), (hq, lens_q)
            torch.testing.assert_close(shared[1], repeated[1], atol=2 ** -6 * float(repeated[1].abs().max()),
                                       rtol=0)
