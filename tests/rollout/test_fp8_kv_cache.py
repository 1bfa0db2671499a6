"""The FP8 KV cache (--kv-cache-dtype fp8_e4m3): E4M3 keys and values with one float32 scale per (token, kv head).
On CPU: the rounding's error bound, the cache layout and its bytes, the reference ops against the same ops on a
dequantized cache, the engine against an emulation (the unquantized engine whose cache stores the rounded keys and
values), block copies of shared prompts, and the refusals. On CUDA (gpu): the Triton kernels against the reference and
the engine's greedy tokens against BF16."""

from __future__ import annotations

import types

import pytest
import torch

from conftest import sharpen
from polyrl.rollout.gpu import ops
from polyrl.rollout.gpu.engine import GPUEngine
from polyrl.rollout.gpu.kv_cache import FP8_KV_DTYPE, KVCache
from polyrl.types import SamplingParams

TEXTS = ["12+34=", "5+6=", "99+1=", "123+456=", "7+70=", "1+2+3+4+5="]
gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _sharp(tmp_path_factory, name, **kw):
    from polyrl.tasks.arithmetic import build_model
    d = str(tmp_path_factory.mktemp(name))
    return sharpen(build_model(d, **kw)[0], d)


@pytest.fixture(scope="module")
def kv_model(tmp_path_factory):
    return _sharp(tmp_path_factory, "kv8", hidden=64, heads=4, kv_heads=2, layers=2)


def test_quantize_heads_error_bound():
    """E4M3 keeps 3 mantissa bits: a value in the normal range (>= 2^-6 of its head's scale) is off by at most half a
    step, 2^-4 of itself; below that the subnormal step is 2^-9 of the scale, so the error is at most 2^-10 of it.
    The head's largest |x| maps onto 448 exactly up to the float32 division; an all-zero head stores zeros, scale 1."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 4, 128, generator=g) * torch.logspace(-3, 3, 50)[:, None, None]
    x[3, 1] = 0.0
    q, s = ops.quantize_heads(x)
    assert q.dtype == FP8_KV_DTYPE and s.shape == (50, 4)
    deq = q.float() * s[..., None]
    bound = torch.maximum(x.abs() * 2.0**-4, s[..., None] * 2.0**-10)
    assert ((deq - x).abs() <= bound * (1 + 1e-6)).all()
    assert torch.equal(s[3, 1], torch.tensor(1.0)) and not q[3, 1].float().any()
    assert torch.allclose(q.float().abs().amax(-1)[s != 1.0], torch.tensor(448.0))


def test_cache_layout_and_bytes():
    """One allocation holds the E4M3 values and the scales; a token and head takes D + 4 bytes per k or v against 2D
    in BF16, so at head_dim 128 the same memory holds 256 / 132 = 1.94x the tokens."""
    cos = sin = torch.zeros(8, 4)
    c = KVCache(3, 2, 128, 10, 16, torch.bfloat16, torch.device("cpu"), cos, sin, kv_dtype=FP8_KV_DTYPE)
    assert c.fp8 and c.data.dtype == FP8_KV_DTYPE and c.scales.shape == (2, 3, 160, 2)
    assert c.data.untyped_storage().data_ptr() == c.scales.untyped_storage().data_ptr()  # sleep frees both at once
    assert len(c.k) == len(c.ks) == 3 and c.ks[1].shape == (160, 2)
    per_fp8 = KVCache.bytes_per_block(3, 2, 128, 16, FP8_KV_DTYPE)
    per_bf16 = KVCache.bytes_per_block(3, 2, 128, 16, torch.bfloat16)
    assert per_fp8 == 2 * 3 * 16 * 2 * (128 + 4) and per_bf16 == 2 * 3 * 16 * 2 * 256
    assert c.nbytes >= 10 * per_fp8 and c.nbytes - 10 * per_fp8 < 256
    c.release()
    assert c.data is None and c.scales is None and c.scales_of  # released together
    c.allocate()
    assert c.scales_of(0)["k_scale"].shape == (160, 2)
    plain = KVCache(3, 2, 128, 10, 16, torch.bfloat16, torch.device("cpu"), cos, sin)
    assert not plain.fp8 and plain.scales_of(0) == {}


def test_reference_ops_on_the_fp8_cache_equal_a_dequantized_cache():
    """rope_store writes quantize_heads of the rotated k and of v (and returns the unrounded ones for prefill);
    decode attention over the FP8 cache equals decode attention over its dequantized copy bit for bit (both multiply
    q by its scale in fp32 first)."""
    g = torch.Generator().manual_seed(1)
    T, hq, hkv, d, S = 11, 4, 2, 16, 64
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=g)
    pos, slots = torch.arange(T), torch.randperm(S, generator=g)[:T]
    cos, sin = torch.randn(32, d // 2, generator=g), torch.randn(32, d // 2, generator=g)
    kc, vc = torch.zeros(S, hkv, d), torch.zeros(S, hkv, d)
    q, k, v = ops.rope_store(qkv, pos, slots, kc, vc, cos, sin, hq, hkv, d)
    k8, v8 = torch.zeros(S, hkv, d, dtype=FP8_KV_DTYPE), torch.zeros(S, hkv, d, dtype=FP8_KV_DTYPE)
    ks, vs = torch.ones(S, hkv), torch.ones(S, hkv)
    q2, k2, v2 = ops.rope_store(qkv, pos, slots, k8, v8, cos, sin, hq, hkv, d, k_scale=ks, v_scale=vs)
    assert torch.equal(q, q2) and torch.equal(k, k2) and torch.equal(v, v2)
    for cache, scale, x in ((k8, ks, k), (v8, vs, v)):
        want_q, want_s = ops.quantize_heads(x)
        assert torch.equal(cache[slots].view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale[slots], want_s)
    B, BS = 3, 4
    bt = torch.stack([torch.randperm(S // BS, generator=g)[:4] for _ in range(B)]).to(torch.int32)
    ctx = torch.tensor([1, 7, 16], dtype=torch.int32)
    qd = torch.randn(B, hq, d, generator=g)
    got = ops.paged_decode_attention(qd, k8, v8, bt, ctx, BS, k_scale=ks, v_scale=vs)
    want = ops.paged_decode_attention(qd, k8.float() * ks[..., None], v8.float() * vs[..., None], bt, ctx, BS)
    assert torch.equal(got, want)


def _emulating_ops():
    """The reference ops whose rope_store writes what an FP8 cache keeps of k and v (q * scale, in fp32) into a cache
    of the model dtype: the unquantized engine with these ops computes what the FP8-cache engine computes."""
    def rope_store(qkv, pos, slots, k_cache, v_cache, *args, **kw):
        q, k, v = ops.rope_store(qkv, pos, slots, k_cache, v_cache, *args, **kw)
        for cache, x in ((k_cache, k), (v_cache, v)):
            xq, sc = ops.quantize_heads(x)
            cache[slots] = (xq.float() * sc[..., None]).to(cache.dtype)
        return q, k, v
    return types.SimpleNamespace(**{**vars(ops), "rope_store": rope_store})


def test_fp8_cache_engine_equals_the_emulation_and_sheds_bytes(kv_model):
    """Greedy tokens and log-probs of the FP8-cache engine equal those of the unquantized engine whose cache holds the
    same rounded keys and values (prefill attends to the unrounded ones in both), exactly: the emulation is the whole
    arithmetic difference. Sampling with n = 3 per prompt (shared prompt blocks, the partial one copied with its
    scales) agrees too. The rounding does change the tokens against the exact cache (recorded, not asserted)."""
    kw = dict(device="cpu", dtype=torch.float32, num_kv_blocks=256, block_size=4)
    f8, emu, exact = GPUEngine(kv_model, kv_cache_dtype="fp8_e4m3", **kw), GPUEngine(kv_model, **kw), GPUEngine(kv_model, **kw)
    emu.ops = emu.model.ops = _emulating_ops()
    assert f8.kv.fp8 and f8.kv.nbytes < 0.6 * exact.kv.nbytes  # head_dim 16: (16 + 4) / 32 bytes per token and head
    ids = [f8.tokenizer(t)["input_ids"] for t in TEXTS]
    for sp in (SamplingParams(temperature=0.0, max_new_tokens=10),
               SamplingParams(n=3, temperature=1.0, max_new_tokens=9, seed=4)):
        a, b = f8.generate(ids, sp), emu.generate(ids, sp)
        assert [s.response_ids for s in a] == [s.response_ids for s in b]
        assert [s.rollout_logprobs for s in a] == [s.rollout_logprobs for s in b]
    assert len({tuple(s.response_ids) for s in a}) > 1
    c = exact.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=10))
    g = f8.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=10))
    assert [s.response_ids[0] for s in g] == [s.response_ids[0] for s in c]  # the first token comes from the prefill
    print("FP8 KV vs exact cache, greedy responses identical:",
          sum(x.response_ids == y.response_ids for x, y in zip(g, c)), "of", len(c))


def test_unwritten_fp8_slots_and_scales_never_reach_the_output(kv_model):
    """Slots past a row's context, and their scales, can hold anything (NaN bytes included): shared prompts copy
    their partial block's values and scales, so a cache filled with NaN gives what a zeroed one gives."""
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=9, seed=5)
    kw = dict(device="cpu", dtype=torch.float32, num_kv_blocks=256, block_size=4, kv_cache_dtype="fp8_e4m3")
    clean, dirty = GPUEngine(kv_model, **kw), GPUEngine(kv_model, **kw)
    ids = [clean.tokenizer(t)["input_ids"] for t in TEXTS]
    clean.kv.data.view(torch.uint8).zero_()
    clean.kv.scales.zero_()
    want = [(s.response_ids, s.rollout_logprobs) for s in clean.generate(ids, sp)]
    bs = dirty.block_size
    dirty.kv.data.view(torch.uint8).fill_(0x7F)  # E4M3's NaN
    dirty.kv.scales.fill_(float("nan"))
    dirty.kv.data.view(torch.uint8)[:, :, :bs].zero_()  # the scratch block that padded rows read stays finite
    dirty.kv.scales[:, :, :bs].fill_(1.0)
    assert [(s.response_ids, s.rollout_logprobs) for s in dirty.generate(ids, sp)] == want


def _cfg(model, *argv):
    from polyrl.cli import build_parser
    from polyrl.config import config_from_args
    return config_from_args(build_parser().parse_args(["train", "--hf-checkpoint", model, *argv]))


def test_kv_cache_dtype_is_refused_where_it_cannot_hold(kv_model, arith_data):
    from polyrl.capabilities import refuse_unhonoured
    from polyrl.config import ConfigError, validate
    from polyrl.rollout.embedded import make_embedded_engine
    with pytest.raises(ValueError, match="--kv-cache-dtype 'fp16'"):
        GPUEngine(kv_model, device="cpu", dtype=torch.float32, num_kv_blocks=64, kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8_e4m3 on CPU"):
        make_embedded_engine(kv_model, device="cpu", kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ConfigError, match="--true-on-policy with --kv-cache-dtype fp8_e4m3"):
        validate(_cfg(kv_model, "--prompt-data", arith_data["train"], "--rm-type", "arithmetic", "--true-on-policy", "--kv-cache-dtype", "fp8_e4m3"),
                 "train")
    for engine in ("embedded", "server"):  # their engines would fail at start; the run is refused before
        with pytest.raises(ConfigError, match="--kv-cache-dtype fp8_e4m3 on CPU"):
            validate(_cfg(kv_model, "--prompt-data", arith_data["train"], "--rm-type", "arithmetic", "--device", "cpu",
                          "--rollout-engine", engine, "--kv-cache-dtype", "fp8_e4m3"), "train")
    ext = _cfg(kv_model, "--rollout-external", "--kv-cache-dtype", "fp8_e4m3")
    with pytest.raises(ConfigError, match="--kv-cache-dtype is not honoured by --rollout-external.*start SGLang"):
        refuse_unhonoured(ext)


def test_launched_servers_get_the_kv_cache_dtype(kv_model):
    from polyrl.rollout.http_engine import server_command
    cfg = _cfg(kv_model, "--rollout-engine", "server", "--kv-cache-dtype", "fp8_e4m3", "--rollout-quantization", "fp8")
    argv = server_command(cfg, "server", 30001, "cpu")
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
    assert argv[argv.index("--rollout-quantization") + 1] == "fp8"
    plain = server_command(_cfg(kv_model, "--rollout-engine", "server"), "server", 30001, "cpu")
    assert "--kv-cache-dtype" not in plain and "--rollout-quantization" not in plain


# ---- CUDA ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_fp8_cache_kernels_against_the_reference():
    """rope_store's E4M3 bytes and scales against ops.quantize_heads of the k / v it returns: the scale is one fp32
    division, which Triton compiles to div.full.f32 (up to 2 ulp off, 2^-22 relative; 2^-20 allowed), so a quotient
    on a rounding boundary can land one E4M3 step away (2^-3 of the value): allowed on under 1% of the elements. Decode attention over the same FP8 cache
    against the reference (fp32 throughout there, BF16 probabilities x values in the kernel: 1e-2 relative, the
    bound the BF16 cache's test uses), with and without context splits, and at head_dim 128 the fused E4M3 output."""
    from polyrl.rollout.gpu import triton_ops as tops
    dev, bf = "cuda", torch.bfloat16
    torch.manual_seed(0)
    for hq, hkv, d in ((14, 2, 64), (28, 4, 128)):
        T, S = 37, 4096
        qkv = torch.randn(T, (hq + 2 * hkv) * d, device=dev, dtype=bf) * 3
        pos, slots = torch.randint(0, 100, (T,), device=dev), torch.randperm(S, device=dev)[:T]
        cos, sin = torch.randn(100, d // 2, device=dev, dtype=bf), torch.randn(100, d // 2, device=dev, dtype=bf)
        k8, v8 = (torch.zeros(S, hkv, d, device=dev, dtype=FP8_KV_DTYPE) for _ in range(2))
        ks, vs = torch.ones(S, hkv, device=dev), torch.ones(S, hkv, device=dev)
        q, k, v = tops.rope_store(qkv, pos, slots, k8, v8, cos, sin, hq, hkv, d, k_scale=ks, v_scale=vs)
        # against the kernel's own rotated k (its RoPE is within BF16 rounding of the reference's, not equal to it)
        for cache, scale, x in ((k8, ks, k), (v8, vs, v)):
            want_q, want_s = ops.quantize_heads(x)
            torch.testing.assert_close(scale[slots], want_s, rtol=2**-20, atol=0)
            got, ref = cache[slots].float(), want_q.float()
            off = got != ref
            assert off.float().mean() < 0.01, f"{off.float().mean():.4f} of the E4M3 values differ"
            assert ((got - ref).abs() <= ref.abs() * 2**-3 + 2**-9)[off].all(), (got - ref).abs().max()
        B, BS, NB = 9, 16, 300
        bt = torch.randperm(NB, device=dev)[:B * 30].view(B, 30).to(torch.int32)
        kc = (torch.randn(NB * BS, hkv, d, device=dev) * 2).to(bf)
        vc = torch.randn(NB * BS, hkv, d, device=dev).to(bf)
        k8, ks = ops.quantize_heads(kc)
        v8, vs = ops.quantize_heads(vc)
        ctx = torch.tensor([1, 2, 15, 16, 17, 64, 65, 300, 480], device=dev, dtype=torch.int32)
        qd = torch.randn(B, hq, d, device=dev, dtype=bf)
        want = ops.paged_decode_attention(qd, k8, v8, bt, ctx, BS, k_scale=ks, v_scale=vs).float()
        split = torch.tensor([128], device=dev, dtype=torch.int32)
        for ns in (1, 4):
            got = tops.paged_decode_attention(qd, k8, v8, bt, ctx, BS, ns, split, k_scale=ks, v_scale=vs).float()
            assert (got - want).norm() / want.norm() < 1e-2, ((got - want).norm() / want.norm(), d, ns)
            if d == 128:
                a8 = tops.paged_decode_attention(qd, k8, v8, bt, ctx, BS, ns, split, fp8_out=True, k_scale=ks, v_scale=vs)
                deq = a8.q.float().view(B, hq, d) * a8.s[..., None]
                # plus E4M3 rounding of the output: <= 2^-4 of each element
                assert (deq - want).norm() / want.norm() < 0.07, ((deq - want).norm() / want.norm(), ns)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_cache_engine_greedy_tokens_against_bf16(tmp_path_factory, record_property):
    """The FP8-cache engine (Triton kernels, CUDA graphs, split decode at small batch) against the BF16-cache engine on
    the same weights. The first token comes from the prefill, which attends to the unrounded keys and values in both:
    equal on every prompt. Later tokens see the rounded cache (each element within 2^-4 of itself), which reorders
    only near-tied logits: whole responses agreeing is recorded, with a floor of 0.3 for the second token (a wrong
    scale, a scale read from the wrong slot or head, or an unscaled cache agrees on about 1/vocab of them)."""
    import gc

    from test_gpu_engine import _model_dir
    path = _model_dir(tmp_path_factory, "qwen2", scale=4.0, name="kv8_qwen2")
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(20, 4096, (48, 24), generator=g).tolist()
    sp = SamplingParams(temperature=0.0, max_new_tokens=24)
    out = {}
    for kv in ("fp8_e4m3", "auto"):
        e = GPUEngine(path, dtype=torch.bfloat16, mem_fraction=0.06, max_batch=64, kv_cache_dtype=kv)
        out[kv] = [s.response_ids for s in e.generate(prompts, sp)]
        out[kv + "_small"] = [s.response_ids for s in e.generate(prompts[:3], sp)]  # split-context decode
        del e
        gc.collect()
        torch.cuda.empty_cache()
    n = len(prompts)
    assert all(a[0] == b[0] for a, b in zip(out["fp8_e4m3"], out["auto"]))
    second = sum(a[1] == b[1] for a, b in zip(out["fp8_e4m3"], out["auto"])) / n
    same = sum(a == b for a, b in zip(out["fp8_e4m3"], out["auto"])) / n
    record_property("kv8_vs_bf16_second_token_equal", second)
    record_property("kv8_vs_bf16_responses_identical", same)
    print(f"FP8 KV cache vs BF16, greedy, {n} prompts x 24 tokens: second token equal {second:.3f}, responses "
          f"identical {same:.3f}")
    assert second >= 0.3
    assert [r[0] for r in out["fp8_e4m3_small"]] == [r[0] for r in out["auto_small"]]
