"""The GPU engine's FP8 linears (--rollout-quantization fp8). On CPU: the scale layout of fused matrices, the kernel's
launch settings, and the FP8 engine (torch reference ops) against the unquantized engine fed the dequantized weights.
On CUDA (gpu): the Triton kernel against the CPU emulation, under a CUDA graph, the FP8 engine's greedy tokens against
the BF16 engine's, and a GRPO step with FP8 rollout on the GPU path."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from conftest import sharpen
from polyrl.rollout.gpu import fp8 as L
from polyrl.rollout.gpu import ops
from polyrl.rollout.gpu.engine import GPUEngine
from polyrl.rollout.gpu.graphs import capture
from polyrl.types import SamplingParams
from polyrl.weight_sync import FP8Transport, InMemoryTransport
from polyrl.weight_sync.quantize import FP8_DTYPE, dequantize_stream, quantize_fp8_block, quantize_stream

gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
TEXTS = ["12+34=", "5+6=", "99+1=", "123+456=", "7+70=", "1+2+3+4+5="]


# ---- pure: layout and launch settings ---------------------------------------------------------------
def test_fused_scale_layout():
    # Qwen2.5-7B's q|k|v: every part a whole number of 128-row blocks, so the stacked grids are the fused grid
    parts = [3584, 512, 512]
    assert L.row_div(parts) == 128 and L.scale_grid(parts, 3584) == (36, 28)
    assert [L.part_scale_rows(parts, j) for j in range(3)] == [(0, 28), (28, 32), (32, 36)]
    # the last part may end in a partial block; an unaligned earlier part switches to one scale row per weight row
    assert L.row_div([256, 128, 100]) == 128 and L.scale_grid([256, 128, 100], 200) == (4, 2)
    assert L.row_div([64, 32, 32]) == 1 and L.scale_grid([64, 32, 32], 64) == (128, 1)
    assert L.part_scale_rows([64, 32, 32], 1) == (64, 96)


@pytest.mark.parametrize("M", [1, 5, 16, 64, 100, 256, 512, 4096])
@pytest.mark.parametrize("N,K", [(4608, 3584), (3584, 18944), (37888, 3584), (96, 200)])
@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_kernel_config_covers_k_once(M, N, K, mode):
    for bw in (False, True):
        c = L.kernel_config(M, N, K, sms=132, mode=mode, blockwise_mm=bw)
        if mode == "w8a8" and bw and M >= L.SCALED_MM_MIN_M and L.scaled_mm_fits(N, K, 128):
            assert c == {"path": "scaled_mm"}
            continue
        if M >= L.DEQUANT_MIN_M[mode]:  # prefill sizes: the dequantized weight through cuBLAS
            assert c == {"path": "dequant"}
            continue
        assert c["path"] == "triton"
        assert 128 % c["BK"] == 0 and c["k_per_split"] % c["BK"] == 0  # one scale per k-tile of a weight row
        assert (c["split"] - 1) * c["k_per_split"] < K <= c["split"] * c["k_per_split"]  # every split non-empty
        assert c["BM"] >= 16
        assert not c["quant_x"] or (mode == "w8a8" and c["BK"] == 128)  # in-kernel quantization: one group per k-tile


def test_scaled_mm_fits_the_engines_scale_grids():
    # cuBLAS reads 128x128 scales in rows of 4 floats: Qwen2.5-7B's four matrices fit, Qwen2.5-1.5B's down_proj
    # (8960 columns: 70 scale columns) and per-row scale layouts (row_div 1) do not
    assert all(L.scaled_mm_fits(n, k, 128) for n, k in [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)])
    assert not L.scaled_mm_fits(1536, 8960, 128) and not L.scaled_mm_fits(4608, 3584, 1)
    assert not L.scaled_mm_fits(320, 200, 128)
    assert L.kernel_config(8192, 4608, 3584, 132, "w8a8", row_div=1, blockwise_mm=True) == {"path": "dequant"}
    assert L.kernel_config(256, 1536, 8960, 132, "w8a8", blockwise_mm=True)["path"] == "triton"


@pytest.mark.parametrize("BM", [16, 64])
def test_expert_tiles_cover_each_group_once(BM):
    """The grouped FP8 kernel's tile map: every row of every expert group in exactly one tile of its own expert, tiles
    never crossing a group's end, within the static bound cdiv(rows, BM) + E, the slots past the last tile marked -1."""
    g = torch.Generator().manual_seed(BM)
    for rows, E in [(1, 8), (37, 16), (600, 5), (4096, 64), (0, 4)]:
        ends = torch.sort(torch.randint(0, rows + 1, (E,), generator=g)).values
        ends[-1] = rows
        tile_e, tile_r = L.expert_tiles(ends.to(torch.int32), rows, BM)
        assert tile_e.shape[0] == -(-rows // BM) + E
        covered = torch.zeros(rows, dtype=torch.long)
        starts = torch.cat([torch.zeros(1, dtype=torch.long), ends[:-1]])
        live = tile_e >= 0
        for e, r in zip(tile_e[live].tolist(), tile_r[live].tolist()):
            assert starts[e] <= r < ends[e]
            covered[r:min(r + BM, int(ends[e]))] += 1
        assert bool((covered == 1).all())
        assert bool((tile_e[int(live.sum()):] == -1).all())  # live tiles first, then only empty slots
    assert L.experts_tile(64 * 8, 128)["BM"] == 16 and L.experts_tile(8192 * 8, 128)["BM"] == 64


def _sharp(tmp_path_factory, name, **kw):
    from polyrl.tasks.arithmetic import build_model
    d = str(tmp_path_factory.mktemp(name))
    return sharpen(build_model(d, **kw)[0], d)


def _same_greedy_generation(q8: GPUEngine, ref: GPUEngine) -> None:
    """Both engines' greedy tokens and log-probs on TEXTS are equal (and not all the same response)."""
    ids = [q8.tokenizer(t)["input_ids"] for t in TEXTS]
    sp = SamplingParams(temperature=0.0, max_new_tokens=8)
    a, b = q8.generate(ids, sp), ref.generate(ids, sp)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert [s.rollout_logprobs for s in a] == [s.rollout_logprobs for s in b]
    assert len({tuple(s.response_ids) for s in a}) > 1  # not a degenerate model


@pytest.mark.parametrize("shape", [dict(hidden=256, heads=2, kv_heads=1, layers=2),  # head_dim 128: block grids align
                                   dict(hidden=64, heads=4, kv_heads=2, layers=2)],  # k/v of 32 rows: per-row scales
                         ids=["aligned", "per-row"])
def test_fp8_engine_on_cpu_equals_the_emulation(tmp_path_factory, shape):
    """The FP8 engine (weights FP8 in its buffer, torch reference ops) computes exactly what the unquantized engine
    computes after loading the dequantized stream: the reference FP8 linear dequantizes in fp32 and rounds to the model
    dtype as the Dequantizer + the engine's cast do, so greedy tokens and log-probs are equal, not close. Its buffer
    is smaller (1 byte per linear weight plus the scales), it takes the quantized stream as it is, and get_weight
    returns the dequantized weights."""
    from transformers import AutoModelForCausalLM
    path = _sharp(tmp_path_factory, "fp8cpu", **shape)
    kw = dict(device="cpu", dtype=torch.float32, num_kv_blocks=256, block_size=4)
    q8, ref = GPUEngine(path, quantization="fp8", **kw), GPUEngine(path, **kw)
    assert q8.loads_fp8_weights and not ref.loads_fp8_weights
    lin = sum(v.numel() for k, v in ref.model.w.items() if k.split(".", 1)[-1] in L.FP8_KEYS)
    assert q8.model.nbytes <= ref.model.nbytes - 3 * lin + 4 * lin // 128 * 2 + 64 * 4 * 4 * shape["layers"]
    hf = dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).named_parameters())
    # the trainer's push: FP8Transport hands the FP8 engine the quantized stream, the other one the dequantized one
    FP8Transport(InMemoryTransport(1 << 16), in_process=True).push(iter(hf.items()), q8, 1)
    ref.update_weights(dequantize_stream(quantize_stream(iter(hf.items()))), 1)
    for name, t in hf.items():
        assert torch.equal(q8.get_weight(name), ref.get_weight(name)), name
    assert q8.model.hf["model.layers.0.self_attn.q_proj.weight"].dtype == FP8_DTYPE
    _same_greedy_generation(q8, ref)
    # a float weight pushed to the FP8 engine is quantized on load; a scale of the wrong grid is refused
    name = "model.layers.1.mlp.down_proj.weight"
    q8.update_weights([(name, hf[name] * 2)], 2)
    assert torch.equal(q8.get_weight(name), L.dequantize(*quantize_fp8_block(hf[name] * 2), 128, torch.float32))
    with pytest.raises(ValueError, match="weight_scale_inv"):
        q8.update_weights([("model.layers.0.self_attn.k_proj.weight_scale_inv", torch.ones(9, 9))], 3)


@pytest.mark.parametrize("shape", [dict(hidden=256, heads=2, kv_heads=1, layers=2),  # expert width 256: block grids align
                                   dict(hidden=64, heads=4, kv_heads=2, layers=2)],  # width 64: per-row scales
                         ids=["aligned", "per-row"])
def test_fp8_moe_engine_on_cpu_equals_the_emulation(tmp_path_factory, shape):
    """Qwen3-MoE with FP8 experts: the engine holds the stacked gate|up and down experts as FP8 with per-expert block
    scales, and its reference experts dequantize them to the model dtype exactly as the Dequantizer + the unquantized
    engine's cast do, so greedy tokens and log-probs equal the FP32 engine's fed the dequantized stream (the router is
    unquantized in both). The trainer's stacked experts reach it per expert (SGLang's names), a float stacked or
    per-expert weight is quantized on load, and get_weight returns the dequantized weights by either name."""
    from transformers import AutoModelForCausalLM
    path = _sharp(tmp_path_factory, "fp8moe", arch="qwen3_moe", **shape)
    kw = dict(device="cpu", dtype=torch.float32, num_kv_blocks=256, block_size=4)
    q8, ref = GPUEngine(path, quantization="fp8", **kw), GPUEngine(path, **kw)
    m, E, H = q8.model, q8.spec.experts, shape["hidden"]
    assert q8.spec.moe_layers == (0, 1) and m.w["0.egu"].dtype == m.w["1.edown"].dtype == FP8_DTYPE
    rows = -(-H // 128) if H % 128 == 0 else H  # gate|up scale rows per expert: the block grid, or one per weight row
    assert tuple(m.w["0.egu.s"].shape) == (E, 2 * rows, -(-H // 128)) and m.w["0.egu.s"].dtype == torch.float32
    experts = sum(v.numel() for k, v in ref.model.w.items() if k.split(".", 1)[-1] in ("egu", "edown"))
    assert q8.model.nbytes < ref.model.nbytes - 3 * experts  # 1 byte per expert weight instead of 4, plus the scales
    hf = dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).named_parameters())
    gu, dn = "model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"
    assert hf[gu].dim() == 3
    FP8Transport(InMemoryTransport(1 << 16), in_process=True).push(iter(hf.items()), q8, 1)
    ref.update_weights(dequantize_stream(quantize_stream(iter(hf.items()))), 1)
    for name in ref.weight_shapes():  # stacked and per-expert names alike
        assert torch.equal(q8.get_weight(name), ref.get_weight(name)), name
    assert m.hf["model.layers.1.mlp.experts.5.up_proj.weight"].dtype == FP8_DTYPE
    _same_greedy_generation(q8, ref)
    # float weights pushed to the FP8 engine are quantized on load: a stacked tensor expert by expert, each of its
    # gate / up parts on its own (as the trainer does), and a per-expert weight as any linear
    q8.update_weights([(gu, hf[gu] * 2), (dn, hf[dn] * 3)], 2)
    deq = lambda w: L.dequantize(*quantize_fp8_block(w), 128, torch.float32)  # noqa: E731
    I = hf[gu].shape[1] // 2
    want = torch.stack([torch.cat([deq(w[:I]), deq(w[I:])]) for w in hf[gu] * 2])
    assert torch.equal(q8.get_weight(gu), want)
    assert torch.equal(q8.get_weight("model.layers.0.mlp.experts.3.up_proj.weight"), want[3, I:])
    assert torch.equal(q8.get_weight(dn), torch.stack([deq(w) for w in hf[dn] * 3]))
    one = "model.layers.1.mlp.experts.6.gate_proj.weight"
    q8.update_weights([(one, torch.ones(I, H))], 3)
    assert bool((q8.get_weight(dn.replace("down_proj", "gate_up_proj"))[6, :I] == 1).all())
    assert not bool((q8.get_weight(dn.replace("down_proj", "gate_up_proj"))[5, :I] == 1).any())
    per_expert = set(q8.weight_shapes()) - set(m.stacked_key)  # every weight and scale, experts by their own names
    assert m.missing(per_expert) == set() and m.missing(per_expert - {one}) == {one}
    with pytest.raises(ValueError, match="weight_scale_inv"):
        q8.update_weights([("model.layers.0.mlp.experts.2.down_proj.weight_scale_inv", torch.ones(9, 9))], 4)


def test_fp8_engine_refuses_other_quantizations(tiny_model):
    with pytest.raises(ValueError, match="--rollout-quantization 'int4'"):
        GPUEngine(tiny_model, device="cpu", dtype=torch.float32, num_kv_blocks=64, quantization="int4")


# ---- CUDA ------------------------------------------------------------------------------------------
def _bound(x, wd, y64):
    """|kernel - exact| for y = x @ wd^T computed with fp32 sums and one rounding to BF16: each output rounds once
    (unit roundoff 2^-8 of |y|) after a sum of K products in fp32, whose error is at most K * 2^-24 * sum |x w| in any
    order of summation (split-K partials included)."""
    K = x.shape[1]
    return 2.0**-8 * y64.abs() + K * 2.0**-24 * (x.double().abs() @ wd.double().abs().t())


@pytest.mark.parametrize("M", [1, 64, 200, 1100])
@pytest.mark.parametrize("N,K,parts", [(768, 512, [512, 128, 128]), (320, 200, [192, 64, 64]), (384, 1024, [384])],
                         ids=["aligned-bias", "per-row-partial", "long-k"])
@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_kernel_against_the_cpu_emulation(M, N, K, parts, mode):
    """w8a16: the Triton kernel rounds each dequantized weight to BF16 exactly as the CPU emulation does (q * scale in
    fp32, then one rounding), so both are the same matmul up to fp32 summation order and the final BF16 rounding:
    each is within _bound of the exact product of those BF16 weights, and so within twice that of the other.
    w8a8: the activations are rounded to E4M3 too (relative error <= 2^-4 in E4M3's normal range, absolute <= 2^-10
    of the group's scale amax / 448 below it), and the weights are not rounded to BF16 (they differ from the
    emulation's by <= 2^-8 relatively), which adds (2^-4 + 2^-8) sum |x w| + 2^-10 sum_k (amax_g(k) / 448) |w_k|.
    Every path is checked at every size: the Triton tiles (split-K or not; w8a8 quantizing the activations in its
    own launch or in the GEMM, which is the same arithmetic, so bit-equal), and the large-M cuBLAS paths: `dequant`
    (the dequantized weight is the emulation's bit for bit, so the result is cuBLAS's BF16 GEMM of the emulation's
    operands, equal to F.linear on them) and, for w8a8 where torch has it, cuBLAS's block-scaled FP8 GEMM of the
    same quantized activations (the w8a8 bound; M padded to 16 rows for it at 200 and 1100)."""
    import torch.nn.functional as F

    from polyrl.rollout.gpu import triton_ops
    bias = N == 768
    g = torch.Generator().manual_seed(M * 7 + N)
    w = torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g) * 0.1
    rd = L.row_div(parts)
    # the engine's layout: each part quantized on its own, grids stacked (expanded to one row per weight row if needed)
    qs, ss = zip(*(quantize_fp8_block(p) for p in w.split(parts)))
    q = torch.cat(qs)
    s = torch.cat([x.repeat_interleave(128, 0)[:n] if rd == 1 else x for x, n in zip(ss, parts)])
    assert tuple(s.shape) == L.scale_grid(parts, K)
    x = (torch.randn(M, K, generator=g)).to(torch.bfloat16)
    b = (torch.randn(N, generator=g) * 0.1).to(torch.bfloat16) if bias else None
    emul = ops.fp8_linear(x, q, s, b, rd)  # CPU: dequantize, round to BF16, matmul
    wd = L.dequantize(q, s, rd, torch.bfloat16)
    y64 = x.double() @ wd.double().t() + (b.double() if bias else 0)
    bound = _bound(x, wd, y64)
    if mode == "w8a8":
        ax = x.double().abs()
        amax = torch.nn.functional.pad(ax, (0, -K % 128)).view(M, -1, 128).amax(-1).repeat_interleave(128, 1)[:, :K]
        bound = (bound + (2.0**-4 + 2.0**-8) * (ax @ wd.double().abs().t())
                 + 2.0**-10 * ((amax / 448) @ wd.double().abs().t())) * (1 + 2.0**-7)
    xc, qc, sc, bc = x.cuda(), q.cuda(), s.cuda(), b.cuda() if bias else None
    assert torch.equal(triton_ops.fp8_dequantize(qc, sc, rd).cpu(), wd)
    c = L.kernel_config(M, N, K, 132, mode)
    tile = c if c["path"] == "triton" else L.kernel_config(L.DEQUANT_MIN_M[mode] - 1, N, K, 132, mode)
    configs = [None, {"path": "dequant"}, {**tile, "split": 1, "k_per_split": -(-K // tile["BK"]) * tile["BK"]}]
    if -(-K // tile["BK"]) >= 2:
        configs.append(L.tile_config(M, N, K, tile["BM"], tile["BN"], tile["BK"], tile["num_warps"],
                                     tile["num_stages"], 2, tile["quant_x"]))
    if mode == "w8a8" and M <= 64 and tile["BK"] == 128:
        configs += [{**cfg, "quant_x": qx} for cfg in configs[2:] for qx in (False, True)]
    if mode == "w8a8" and M > 128 and triton_ops.blockwise_mm_available(xc.device) and L.scaled_mm_fits(N, K, rd):
        configs.append({"path": "scaled_mm"})
    outs = {}
    for cfg in configs:
        y = triton_ops.fp8_linear(xc, qc, sc, bc, rd, config=cfg, mode=mode).cpu()
        outs[json.dumps(cfg, sort_keys=True)] = y
        if cfg == {"path": "dequant"}:
            assert torch.equal(y, F.linear(xc, wd.cuda(), bc).cpu())
            err_bound = _bound(x, wd, y64)  # the emulation's own numerics, whatever the mode
        else:
            err_bound = bound
        err = (y.double() - y64).abs()
        assert (err <= err_bound).all(), (cfg, (err - err_bound).max().item())
        assert ((y.double() - emul.double()).abs() <= 2 * err_bound).all(), cfg
    assert all(not c.any() for c in triton_ops._COUNTERS.values())  # split-K tile counters left at zero
    for cfg in configs:  # the in-kernel activation quantization is the separate launch's arithmetic: bit-equal
        if cfg and cfg.get("quant_x"):
            twin = json.dumps({**cfg, "quant_x": False}, sort_keys=True)
            assert torch.equal(outs[json.dumps(cfg, sort_keys=True)], outs[twin]), cfg


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode,M", [("w8a16", 24), ("w8a8", 24), ("w8a8", 200)])
def test_fp8_kernel_under_a_cuda_graph_reads_weights_in_place(mode, M):
    """A captured FP8 linear replays against whatever the weight and scale buffers hold (weight sync writes in place):
    the Triton kernels (K split: the last program of each tile adds the partial sums, in a fixed order, so every
    replay gives the same bits and the tile counters are left at zero), and at M = 200 (w8a8) cuBLAS's block-scaled
    GEMM."""
    from polyrl.rollout.gpu import triton_ops
    N, K = 512, 2048
    assert M >= L.SCALED_MM_MIN_M or L.kernel_config(M, N, K, 132, mode)["split"] > 1
    q, s = quantize_fp8_block(torch.randn(N, K, device="cuda"))
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    eager = triton_ops.fp8_linear(x, q, s, mode=mode)
    g, out = capture(lambda: triton_ops.fp8_linear(x, q, s, mode=mode))
    for _ in range(20):
        g.replay()
        assert torch.equal(out, eager)
    q2, s2 = quantize_fp8_block(torch.randn(N, K, device="cuda"))
    q.copy_(q2)
    s.copy_(s2)
    g.replay()
    assert torch.equal(out, triton_ops.fp8_linear(x, q, s, mode=mode))
    assert not torch.equal(out, eager)
    assert all(not c.any() for c in triton_ops._COUNTERS.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("H,I", [(3584, 18944), (200, 320)])
def test_fused_activation_quantization_is_the_separate_launch(H, I):
    """add_rmsnorm_fp8 / silu_mul_fp8 quantize their rounded outputs with quantize_activations' arithmetic (per token
    and 128 columns, partial last group included), so the E4M3 values and scales are the same bit for bit, and a w8a8
    linear given them (FP8Act) returns what it returns for the unquantized activations."""
    from polyrl.rollout.gpu import triton_ops as T
    g = torch.Generator(device="cuda").manual_seed(H)
    x, r = (torch.randn(48, H, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    w = (torch.rand(H, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
    for res in (None, r):
        y, s = T.add_rmsnorm(x, res, w, 1e-6)
        y8, s8 = T.add_rmsnorm_fp8(x, res, w, 1e-6)
        xq, xs = T.quantize_activations(y)
        assert torch.equal(s8, s) and torch.equal(y8.q.view(torch.uint8), xq.view(torch.uint8)) and torch.equal(y8.s, xs)
    gu = torch.randn(48, 2 * I, device="cuda", generator=g).to(torch.bfloat16)
    a, a8 = T.silu_mul(gu), T.silu_mul_fp8(gu)
    xq, xs = T.quantize_activations(a)
    assert torch.equal(a8.q.view(torch.uint8), xq.view(torch.uint8)) and torch.equal(a8.s, xs)
    q, sc = quantize_fp8_block(torch.randn(256, I, device="cuda", generator=g) * 0.05)
    assert torch.equal(T.fp8_linear(a8, q, sc), T.fp8_linear(a, q, sc, mode="w8a8"))
    assert T.fp8_activations(48, torch.bfloat16) == (T.FP8_MODE == "w8a8")
    assert not T.fp8_activations(L.SCALED_MM_MIN_M, torch.bfloat16) and not T.fp8_activations(48, torch.float32)
    # paged decode attention with head_dim 128 (one head per activation group), with and without context splits
    B, hq, hkv, d, BS, NB = 9, 28, 4, 128, 16, 300
    kc, vc = (torch.randn(NB * BS, hkv, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    qh = torch.randn(B, hq, d, device="cuda", generator=g).to(torch.bfloat16)
    bt = torch.randperm(NB, device="cuda", generator=g)[:B * 30].view(B, 30).to(torch.int32)
    ctx = torch.tensor([1, 2, 15, 16, 17, 64, 65, 300, 480], device="cuda", dtype=torch.int32)
    split = torch.tensor([128], device="cuda", dtype=torch.int32)
    for ns in (1, 4):
        o = T.paged_decode_attention(qh, kc, vc, bt, ctx, BS, ns, split)
        o8 = T.paged_decode_attention(qh, kc, vc, bt, ctx, BS, ns, split, fp8_out=True)
        xq, xs = T.quantize_activations(o.reshape(B, -1))
        assert torch.equal(o8.q.view(torch.uint8), xq.view(torch.uint8)) and torch.equal(o8.s, xs), ns


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_engine_fused_quantization_changes_no_bit(tmp_path_factory, monkeypatch):
    """The w8a8 engine's decode takes E4M3 activations from its norms, SiLU and attention (head_dim 128 here) instead
    of quantizing them in their own launches: the same arithmetic, so greedy tokens and log-probs are identical."""
    from test_gpu_engine import _model_dir

    from polyrl.rollout.gpu import triton_ops
    path = _model_dir(tmp_path_factory, "qwen2", hidden=512, heads=4, kv_heads=2, scale=4.0, name="fp8_hd128")
    monkeypatch.setattr(triton_ops, "FP8_MODE", "w8a8")
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(20, 4096, (16, 24), generator=g).tolist()
    sp = SamplingParams(temperature=0.0, max_new_tokens=12)
    out = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(triton_ops, "fp8_activations", lambda M, dtype: False)
        e = GPUEngine(path, quantization="fp8", dtype=torch.bfloat16, mem_fraction=0.05, max_batch=16)
        assert e.model.fp8_attention_out(16) == fused
        out.append([(s.response_ids, s.rollout_logprobs) for s in e.generate(prompts, sp)])
        del e
    assert out[0] == out[1]
    assert len({tuple(r) for r, _ in out[0]}) > 1


def _grouped_case(E, N, K, parts, S, seed):
    """FP8 experts [E, N, K] in the engine's layout (each expert's parts quantized on their own) and S BF16 rows
    grouped by random experts (some empty): (x, q, s, row_div, offs, dequantized BF16 experts)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E, N, K, generator=g) * torch.rand(E, N, 1, generator=g) * 0.1
    rd = L.row_div(parts)
    qs, ss = [], []
    for we in w:
        pq, ps = zip(*(quantize_fp8_block(p) for p in we.split(parts)))
        qs.append(torch.cat(pq))
        ss.append(torch.cat([x.repeat_interleave(128, 0)[:n] if rd == 1 else x for x, n in zip(ps, parts)]))
    q, s = torch.stack(qs), torch.stack(ss)
    assert tuple(s.shape) == (E, *L.scale_grid(parts, K))
    experts = torch.randint(0, max(1, E - 2), (S,), generator=g).sort().values  # the last two experts get no rows
    offs = torch.searchsorted(experts, torch.arange(1, E + 1), out_int32=True)
    x = torch.randn(S, K, generator=g).to(torch.bfloat16)
    return x, q, s, rd, offs, L.dequantize(q, s, rd, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("S", [1, 7, 64, 600])
@pytest.mark.parametrize("E,N,K,parts", [(8, 512, 256, [256, 256]), (6, 192, 200, [96, 96]), (4, 200, 96, [200])],
                         ids=["aligned-gate-up", "per-row-partial", "down-partial"])
def test_fp8_grouped_kernel_against_the_emulation(S, E, N, K, parts):
    """The grouped FP8 kernel rounds each dequantized expert weight to BF16 as the emulation does (q * scale in fp32,
    one rounding), so per row it is the emulation's product up to fp32 summation order and the final BF16 rounding:
    within _bound (one BF16 rounding of |y|, plus K * 2^-24 sum |x w| for any fp32 order) of the exact product of those
    BF16 weights, and within twice that of the emulation's own grouped GEMM. The prefill path (the experts dequantized
    on the GPU) gives the emulation's weights bit for bit, so torch's grouped GEMM on them is the emulation's GEMM."""
    from polyrl.rollout.gpu import triton_ops
    x, q, s, rd, offs, wd = _grouped_case(E, N, K, parts, S, seed=S * 31 + N)
    emul = ops.grouped_linear(x.float(), wd.float(), offs).to(torch.bfloat16)  # fp32 sums of the BF16 operands
    y64 = torch.empty(S, N, dtype=torch.float64)
    bound = torch.empty(S, N, dtype=torch.float64)
    start = 0
    for e, end in enumerate(offs.tolist()):
        y64[start:end] = x[start:end].double() @ wd[e].double().t()
        bound[start:end] = _bound(x[start:end], wd[e], y64[start:end])
        start = end
    xc, qc, sc, oc = x.cuda(), q.cuda(), s.cuda(), offs.cuda()
    assert torch.equal(triton_ops.fp8_dequantize(qc, sc, rd).cpu(), wd)
    for bm in (16, 64):
        y = triton_ops.fp8_grouped_linear(xc, qc, sc, oc, rd, config={**L.experts_tile(S, E), "BM": bm}).cpu()
        err = (y.double() - y64).abs()
        assert (err <= bound).all(), (bm, (err - bound).max().item())
        assert ((y.double() - emul.double()).abs() <= 2 * bound).all(), bm
    deq = triton_ops.grouped_linear(xc, triton_ops.fp8_dequantize(qc, sc, rd), oc)
    assert torch.equal(deq, triton_ops.grouped_linear(xc, wd.cuda(), oc))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_moe_experts_under_a_cuda_graph(monkeypatch):
    """The FP8 experts (route, sort, the tile map, two grouped FP8 GEMMs) captured in a CUDA graph: no host sync, a
    static grid, so a replay follows new activations, new routes and new weights written in place to the eager result
    bit for bit; the prefill path (experts dequantized for the grouped BF16 GEMM) agrees with the kernel path within
    the BF16 roundings of the intermediate activations (rel. 2^-6: a few 2^-8 roundings compounded through two GEMMs
    and SiLU, measured ~2^-8)."""
    from polyrl.rollout.gpu import fp8 as F8
    from polyrl.rollout.gpu import triton_ops as T
    T_, H, I, E, k = 24, 256, 384, 16, 4
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T_, H, device="cuda", generator=g).to(torch.bfloat16)
    router = (torch.randn(E, H, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
    gq, gs = quantize_fp8_block(torch.randn(E, 2 * I, H, device="cuda", generator=g) * H ** -0.5)
    dq, ds = quantize_fp8_block(torch.randn(E, H, I, device="cuda", generator=g) * I ** -0.5)
    # gate and up of each expert quantized on their own: their 128-row grids stack (I is a multiple of 128)
    gq2, gs2 = quantize_fp8_block(torch.cat([gq[:, :I].float(), gq[:, I:].float()], 1))
    scales = (gs, 128, ds, 128)

    def run():
        gates, ex = T.moe_route(x, router, k, True)
        return T.moe_experts(x, gq, dq, gates, ex, scales=scales), ex

    eager, _ = run()
    graph, (out, routes) = capture(run)
    graph.replay()
    assert torch.equal(out, eager)
    x.copy_(torch.randn(T_, H, device="cuda", generator=g).to(torch.bfloat16))
    gq.copy_(gq2)
    gs.copy_(gs2)
    graph.replay()
    again, again_routes = run()
    assert torch.equal(routes, again_routes) and torch.equal(out, again)
    assert not torch.equal(out, eager)
    monkeypatch.setattr(F8, "EXPERTS_DEQUANT_MIN_ROWS", 0)
    prefill, _ = run()
    rel = ((prefill.float() - again.float()).norm() / again.float().norm()).item()
    print(f"FP8 experts: kernel vs dequantized-prefill path, relative difference {rel:.2e}")
    assert rel < 2.0**-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_moe_engine_against_the_emulation_and_bf16(tmp_path_factory, record_property, monkeypatch):
    """The Qwen3-MoE engine with FP8 experts and linears (w8a16, the mode whose weights are the emulation's; CUDA
    graphs, the grouped FP8 kernel at decode, the dequantized experts at prefill) against (a) the BF16 engine fed the
    same dequantized weights and (b) the BF16 engine on the unquantized weights, greedy. Recorded, not asserted equal:
    in BF16 a router near-tie flips an expert (test_gpu_engine.py), and FP8 moves every weight by up to 2^-4 of its
    block's largest value. Asserted: first tokens equal to the emulation's on >= 0.9 of the prompts (prefill runs both
    on the same BF16 weights through the same GEMMs; only near-ties can part them), and over the tokens before the
    responses part the median |log-prob difference| is below 0.02, BF16's dense noise level (same file)."""
    import gc
    from test_gpu_engine import _model_dir
    from transformers import AutoModelForCausalLM

    from polyrl.rollout.gpu import triton_ops
    monkeypatch.setattr(triton_ops, "FP8_MODE", "w8a16")
    path = _model_dir(tmp_path_factory, "qwen3_moe", scale=2.0, name="fp8_moe")
    kw = dict(dtype=torch.bfloat16, mem_fraction=0.06, max_batch=64)
    hf = [(n, p.detach().cuda()) for n, p in AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).named_parameters()]
    prompts = torch.randint(20, 4096, (48, 24), generator=torch.Generator().manual_seed(0)).tolist()
    sp = SamplingParams(temperature=0.0, max_new_tokens=24)
    out = {}
    for name in ("fp8", "emulation", "bf16"):
        e = GPUEngine(path, quantization="fp8" if name == "fp8" else "none", **kw)
        if name != "bf16":
            FP8Transport(InMemoryTransport(), in_process=True).push(iter(hf), e, 1)
        if name == "fp8":
            assert e.model.w["0.egu"].dtype == FP8_DTYPE
            assert e.model.hf["model.layers.3.mlp.experts.15.down_proj.weight_scale_inv"].shape == (4, 2)
        out[name] = [(s.response_ids, s.rollout_logprobs) for s in e.generate(prompts, sp)]
        del e
        gc.collect()
        torch.cuda.empty_cache()
    n = len(prompts)
    same = {k: sum(a[0] == b[0] for a, b in zip(out["fp8"], out[k])) / n for k in ("emulation", "bf16")}
    first = {k: sum(a[0][0] == b[0][0] for a, b in zip(out["fp8"], out[k])) / n for k in ("emulation", "bf16")}
    diffs = []
    for (ra, la), (rb, lb) in zip(out["fp8"], out["emulation"]):
        for ta, tb, xa, xb in zip(ra, rb, la, lb):
            diffs.append(abs(xa - xb))
            if ta != tb:
                break
    d = torch.tensor(diffs)
    stats = {"median": d.median().item(), "p99": d.quantile(0.99).item(), "max": d.max().item(), "tokens": len(diffs)}
    for k in ("emulation", "bf16"):
        record_property(f"fp8_moe_vs_{k}_responses_identical", same[k])
        record_property(f"fp8_moe_vs_{k}_first_token_equal", first[k])
    record_property("fp8_moe_vs_emulation_logprob_absdiff", stats)
    print(f"FP8 MoE engine (w8a16) greedy, {n} prompts x 24 tokens: identical to the emulation {same['emulation']:.3f} "
          f"(first token {first['emulation']:.3f}), to BF16 {same['bf16']:.3f} (first token {first['bf16']:.3f}); "
          f"log-prob |diff| vs the emulation before parting: {stats}")
    assert first["emulation"] >= 0.9
    assert stats["median"] < 0.02


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from test_gpu_engine import _model_dir
    return _model_dir(tmp_path_factory, "qwen2", scale=4.0, name="fp8_qwen2")  # head_dim 64, k/v 128 rows: aligned


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_fp8_engine_greedy_tokens_against_bf16(gpu_model, record_property, monkeypatch, mode):
    """Greedy tokens of the FP8 engine (Triton FP8 linears, CUDA graphs) against (a) the BF16 engine fed the same
    dequantized weights (the emulation: same weights, only summation order differs) and (b) the BF16 engine on the
    unquantized weights. Agreement is recorded, not asserted equal: near-ties flip. Floors: (a) w8a16 only, >= 0.5 of
    the responses identical, since only fp32 summation order separates them and a flip needs two logits within
    rounding of each other (w8a8 rounds the activations to E4M3 too, so its responses are not the emulation's: H100,
    2026-11-25, 0/48 identical over 24 tokens); (b) first tokens equal on >= 0.5 (w8a16) / >= 0.3 (w8a8) of the
    prompts, since FP8 moves each weight (and w8a8 each activation) by at most 2^-4 of its block's largest value,
    which reorders only near-tied top logits (measured 0.60 / 0.52). A wrong scale row or column, or a weight read
    without its scale, agrees on about 1/vocab (0.0002) of the tokens."""
    import gc
    from transformers import AutoModelForCausalLM

    from polyrl.rollout.gpu import triton_ops
    monkeypatch.setattr(triton_ops, "FP8_MODE", mode)
    kw = dict(dtype=torch.bfloat16, mem_fraction=0.06, max_batch=64)
    hf = [(n, p.detach().cuda()) for n, p in AutoModelForCausalLM.from_pretrained(gpu_model, dtype=torch.float32).named_parameters()]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(20, 4096, (48, 24), generator=g).tolist()
    sp = SamplingParams(temperature=0.0, max_new_tokens=24)
    out = {}
    for name in ("fp8", "emulation", "bf16"):
        e = GPUEngine(gpu_model, quantization="fp8" if name == "fp8" else "none", **kw)
        if name != "bf16":
            FP8Transport(InMemoryTransport(), in_process=True).push(iter(hf), e, 1)
        out[name] = [s.response_ids for s in e.generate(prompts, sp)]
        if name == "fp8":
            assert e.model.hf["model.layers.0.mlp.down_proj.weight"].dtype == FP8_DTYPE
        del e
        gc.collect()
        torch.cuda.empty_cache()
    n = len(prompts)
    same = {k: sum(a == b for a, b in zip(out["fp8"], out[k])) / n for k in ("emulation", "bf16")}
    first = sum(a[0] == b[0] for a, b in zip(out["fp8"], out["bf16"])) / n
    record_property("fp8_vs_emulation_responses_identical", same["emulation"])
    record_property("fp8_vs_bf16_responses_identical", same["bf16"])
    record_property("fp8_vs_bf16_first_token_equal", first)
    print(f"FP8 engine ({mode}) greedy, {n} prompts x 24 tokens: identical to the emulation {same['emulation']:.3f}, "
          f"to BF16 {same['bf16']:.3f} (first token {first:.3f})")
    assert first >= (0.5 if mode == "w8a16" else 0.3)
    if mode == "w8a16":
        assert same["emulation"] >= 0.5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grpo_step_with_fp8_rollout_on_the_gpu_path(tiny_model, arith_data, tmp_path, caplog):
    """polyrl train on CUDA with --rollout-quantization fp8: the embedded GPU engine holds FP8 linears (its start-up
    line says so), takes the quantized pushes, and the rollout/train log-prob gap is logged every step (recorded
    beside the BF16 run's; the tiny model's k/v rows take the per-row scale layout)."""
    from polyrl.cli import main
    gaps = {}
    for q in ("none", "fp8"):
        run = tmp_path / q
        with caplog.at_level(logging.INFO, logger="polyrl.rollout.gpu.engine"):
            assert main(["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--rm-type",
                         "arithmetic", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
                         "--rollout-max-response-len", "8", "--num-rollout", "2", "--run-dir", str(run), "--device",
                         "cuda", "--rollout-quantization", q, "--use-tis", "--rollout-mem-fraction", "0.1",
                         "--quiet"]) == 0
        gaps[q] = [json.loads(line)["train_rollout_logprob_abs_diff"] for line in open(run / "metrics.jsonl")]
    assert any("(linears FP8)" in r.getMessage() for r in caplog.records)
    print(f"train_rollout_logprob_abs_diff per step on the GPU path: {gaps}")
    assert len(gaps["fp8"]) == 2 and all(0 < d < 1 for d in gaps["fp8"]), gaps
