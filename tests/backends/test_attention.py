"""polyrl.backends.gqa: the GQA head repeat used by the trainers' varlen attention (FSDP, Megatron) and the engine's
prefill, and the FSDP varlen attention that uses it."""

from __future__ import annotations

import pytest
import torch

from polyrl.backends.gqa import repeat_kv_heads


def test_repeat_kv_heads_equals_repeat_interleave():
    x = torch.randn(9, 2, 16)
    assert torch.equal(repeat_kv_heads(x, 14), x.repeat_interleave(7, dim=1))
    assert torch.equal(repeat_kv_heads(x, 2), x)  # no GQA: the heads as they are


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
