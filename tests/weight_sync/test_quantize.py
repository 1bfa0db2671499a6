"""FP8 block quantization of the weight stream (polyrl.weight_sync.quantize): per-block error bounds derived from E4M3,
the names and scale layout SGLang's block-FP8 loader allocates, pairing across buckets, and the same dequantized
weights in a `polyrl serve` after a push over gloo or disk as in process."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from polyrl.rollout.embedded import EmbeddedEngine
from polyrl.weight_sync import FP8Transport, InMemoryTransport
from polyrl.weight_sync.distributed import DiskTransport, DistributedTransport, check_weights_equal, decode_tensor
from polyrl.weight_sync.quantize import (BLOCK, FP8_DTYPE, FP8_MAX, QUANTIZATION_CONFIG, dequantize_fp8_block,
                                         dequantize_stream, is_quantized_weight, quantize_fp8_block, quantize_stream,
                                         scale_shape)


def blocky(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    """Gaussian weights whose 128x128 blocks span 10 orders of magnitude, with an all-zero block and exact zeros."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g)
    so, si = scale_shape((out, inp))
    mag = 10.0 ** torch.empty(so, si).uniform_(-8, 2, generator=g)
    w = w * mag.repeat_interleave(128, 0)[:out].repeat_interleave(128, 1)[:, :inp]
    if so * si > 1:
        w[:128, :128] = 0  # a block of zeros: any scale, zeros back
    w[out // 2 + out % 2, inp // 2] = 0.0
    return w


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (64, 64), (129, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_error_per_block_is_within_e4m3_precision(shape, dtype):
    """The bound, from E4M3's format (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; max 448, smallest normal
    2^-6, subnormal spacing 2^-9). Each block's scale s = amax / 448 maps its largest |w| to 448, a normal number, so
    y = w / s lies in [-448, 448] and no element is clipped. Rounding y to nearest: for |y| >= 2^-6 (normal), with
    2^e <= |y| < 2^(e+1) the spacing is 2^(e-3), so |q - y| <= 2^(e-4) <= 2^-4 |y|; below 2^-6 (subnormal) the
    spacing is 2^-9, so |q - y| <= 2^-10. Times s: |dequant - w| <= max(2^-4 |w|, 2^-10 s), and since |w| <= amax,
    <= 2^-4 amax for every element of the block. The float32 divide and multiply each add a relative 2^-24, covered
    by the extra 2^-22 |w|. The block's largest element lands on 448 exactly, so it comes back within those float32
    roundings."""
    w = blocky(*shape).to(dtype)
    q, s = quantize_fp8_block(w)
    assert q.dtype == FP8_DTYPE and tuple(q.shape) == shape
    assert s.dtype == torch.float32 and tuple(s.shape) == scale_shape(shape)
    d = dequantize_fp8_block(q, s)
    x = w.float()
    s_full = s.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    err = (d - x).abs()
    bound = torch.maximum(2.0**-4 * x.abs(), 2.0**-10 * s_full) + 2.0**-22 * x.abs()
    assert (err <= bound).all(), (err / bound).max()
    so, si = s.shape
    pad = torch.nn.functional.pad
    err_b = pad(err, (0, si * 128 - shape[1], 0, so * 128 - shape[0])).view(so, 128, si, 128).amax(dim=(1, 3))
    amax = pad(x.abs(), (0, si * 128 - shape[1], 0, so * 128 - shape[0])).view(so, 128, si, 128).amax(dim=(1, 3))
    assert (err_b <= 2.0**-4 * amax * (1 + 2.0**-20)).all()
    assert torch.allclose(s, torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)))
    assert (q.float().abs() <= FP8_MAX).all() and torch.isfinite(d).all()
    top = x.abs() == amax.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    assert torch.allclose(d[top & (x != 0)], x[top & (x != 0)], rtol=2.0**-22, atol=0)
    if math.prod(s.shape) > 1:
        assert (d[:128, :128] == 0).all()


# SGLang's block-FP8 linear (python/sglang/srt/layers/quantization/fp8.py, Fp8LinearMethod.create_fp8_weight_, with a
# fp8-serialized checkpoint and weight_block_size [block_n, block_k]) registers, per linear layer:
#   "weight"            float8_e4m3fn  (output_size_per_partition, input_size_per_partition)
#   "weight_scale_inv"  float32        ((output + block_n - 1) // block_n, (input + block_k - 1) // block_k)
# and the checkpoint config Fp8Config.from_config reads: quant_method "fp8", activation_scheme "dynamic" (required with
# block quantization), weight_block_size; HF's block-FP8 checkpoints add fmt "e4m3". Embeddings, norms, LM head and
# routers are not LinearBase layers with that method (VocabParallelEmbedding, RMSNorm, ReplicatedLinear router kept
# unquantized), so they load in the model's dtype. Rows: (HF name, shape) -> the wire entries (name, dtype, shape).
SGLANG_TABLE = [
    ("model.layers.0.self_attn.q_proj.weight", (256, 384),
     [("model.layers.0.self_attn.q_proj.weight", FP8_DTYPE, (256, 384)),
      ("model.layers.0.self_attn.q_proj.weight_scale_inv", torch.float32, (2, 3))]),
    ("model.layers.0.self_attn.k_proj.weight", (128, 384),
     [("model.layers.0.self_attn.k_proj.weight", FP8_DTYPE, (128, 384)),
      ("model.layers.0.self_attn.k_proj.weight_scale_inv", torch.float32, (1, 3))]),
    ("model.layers.0.mlp.down_proj.weight", (384, 640),
     [("model.layers.0.mlp.down_proj.weight", FP8_DTYPE, (384, 640)),
      ("model.layers.0.mlp.down_proj.weight_scale_inv", torch.float32, (3, 5))]),
    ("model.layers.0.mlp.gate_proj.weight", (200, 130),  # partial blocks at both edges: ceil
     [("model.layers.0.mlp.gate_proj.weight", FP8_DTYPE, (200, 130)),
      ("model.layers.0.mlp.gate_proj.weight_scale_inv", torch.float32, (2, 2))]),
    ("model.layers.0.mlp.experts.3.up_proj.weight", (256, 128),
     [("model.layers.0.mlp.experts.3.up_proj.weight", FP8_DTYPE, (256, 128)),
      ("model.layers.0.mlp.experts.3.up_proj.weight_scale_inv", torch.float32, (2, 1))]),
    ("model.layers.0.self_attn.q_proj.bias", (256,), [("model.layers.0.self_attn.q_proj.bias", torch.bfloat16, (256,))]),
    ("model.embed_tokens.weight", (512, 128), [("model.embed_tokens.weight", torch.bfloat16, (512, 128))]),
    ("lm_head.weight", (512, 128), [("lm_head.weight", torch.bfloat16, (512, 128))]),
    ("model.norm.weight", (128,), [("model.norm.weight", torch.bfloat16, (128,))]),
    ("model.layers.0.input_layernorm.weight", (128,), [("model.layers.0.input_layernorm.weight", torch.bfloat16, (128,))]),
    ("model.layers.0.self_attn.q_norm.weight", (64,), [("model.layers.0.self_attn.q_norm.weight", torch.bfloat16, (64,))]),
    ("model.layers.0.mlp.gate.weight", (8, 128), [("model.layers.0.mlp.gate.weight", torch.bfloat16, (8, 128))]),
    ("model.layers.0.mlp.shared_expert_gate.weight", (1, 128),
     [("model.layers.0.mlp.shared_expert_gate.weight", torch.bfloat16, (1, 128))]),
    ("model.layers.0.mlp.gate.e_score_correction_bias", (8,),
     [("model.layers.0.mlp.gate.e_score_correction_bias", torch.bfloat16, (8,))]),
]


def test_names_dtypes_and_scale_shapes_are_sglangs():
    stream = [(n, torch.randn(s).to(torch.bfloat16)) for n, s, _ in SGLANG_TABLE]
    got = [(n, t.dtype, tuple(t.shape)) for n, t in quantize_stream(stream)]
    assert got == [e for _, _, entries in SGLANG_TABLE for e in entries]
    assert QUANTIZATION_CONFIG == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "weight_block_size": [128, 128]}
    assert BLOCK == (128, 128)
    # on disk (--weight-sync disk): safetensors keeps the names and writes FP8 as F8_E4M3, SGLang's checkpoint dtype
    q = dict(quantize_stream(stream[:1]))
    import tempfile, os, json, struct
    with tempfile.TemporaryDirectory() as d:
        save_file(q, os.path.join(d, "m.safetensors"))
        raw = open(os.path.join(d, "m.safetensors"), "rb").read()
        header = json.loads(raw[8: 8 + struct.unpack("<Q", raw[:8])[0]])
        assert header["model.layers.0.self_attn.q_proj.weight"]["dtype"] == "F8_E4M3"
        assert header["model.layers.0.self_attn.q_proj.weight_scale_inv"]["dtype"] == "F32"
        back = load_file(os.path.join(d, "m.safetensors"))
        assert all(torch.equal(back[k].view(torch.uint8) if back[k].dtype == FP8_DTYPE else back[k],
                               v.view(torch.uint8) if v.dtype == FP8_DTYPE else v) for k, v in q.items())


def test_stacked_experts_leave_per_expert_under_sglangs_names(monkeypatch, tmp_path):
    """transformers 5's stacked experts (gate_up_proj [E, 2I, H]: gate rows, then up rows; down_proj [E, H, I]) leave
    as the per-expert FP8 weights and block scales of Qwen3-30B-A3B-FP8-style checkpoints, which SGLang's FP8 MoE loader
    maps onto its w13 / w2 parameters (Qwen3MoeForCausalLM.load_weights via FusedMoE.make_expert_params_mapping: names
    `experts.{e}.{gate,up,down}_proj.`; Fp8MoEMethod.create_fp8_moe_weight_: w13_weight_scale_inv
    [E, 2 ceil(I/128), ceil(H/128)], w2_weight_scale_inv [E, ceil(H/128), ceil(I/128)], i.e. one [ceil(out/128),
    ceil(in/128)] grid per expert and part). Each part is quantized on its own, the same bits whatever the chunking;
    the router stays unquantized; with stacked_experts=False (GPT-OSS's transposed layout) they pass as they are."""
    E, I, H = 3, 200, 130  # partial blocks at both edges
    g = torch.Generator().manual_seed(0)
    gu, dn = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    router = torch.randn(E, H, generator=g)
    m = "model.layers.1.mlp."
    stream = [(m + "gate.weight", router), (m + "experts.gate_up_proj", gu), (m + "experts.down_proj", dn)]
    got = list(quantize_stream(stream))
    want = [(m + "gate.weight", torch.float32, (E, H))]
    for e in range(E):
        for part in ("gate_proj", "up_proj"):
            want += [(f"{m}experts.{e}.{part}.weight", FP8_DTYPE, (I, H)),
                     (f"{m}experts.{e}.{part}.weight_scale_inv", torch.float32, (2, 2))]
    for e in range(E):
        want += [(f"{m}experts.{e}.down_proj.weight", FP8_DTYPE, (H, I)),
                 (f"{m}experts.{e}.down_proj.weight_scale_inv", torch.float32, (2, 2))]
    assert [(n, t.dtype, tuple(t.shape)) for n, t in got] == want
    out = dict(got)
    for e in range(E):
        for name, w in ((f"{m}experts.{e}.gate_proj", gu[e, :I]), (f"{m}experts.{e}.up_proj", gu[e, I:]),
                        (f"{m}experts.{e}.down_proj", dn[e])):
            q, sc = quantize_fp8_block(w)
            assert torch.equal(out[name + ".weight"].view(torch.uint8), q.view(torch.uint8)) and torch.equal(
                out[name + ".weight_scale_inv"], sc), name
    save_file(out, str(tmp_path / "experts.safetensors"))  # disk sync / FP8 checkpoints: no two share storage
    monkeypatch.setattr("polyrl.weight_sync.quantize._CHUNK_ELEMENTS", 1)  # one expert at a time: the same bits
    again = list(quantize_stream(stream))
    assert [n for n, _ in again] == [n for n, _ in got]
    assert all(torch.equal(a.view(torch.uint8) if a.dtype == FP8_DTYPE else a, b.view(torch.uint8) if b.dtype == FP8_DTYPE else b)
               for (_, a), (_, b) in zip(again, got))
    assert [(n, t.dtype) for n, t in quantize_stream(stream, stacked_experts=False)] == [(n, t.dtype) for n, t in stream]


def test_transformers_engine_takes_per_expert_fp8_weights(tmp_path):
    """The transformers engine holds Qwen3-MoE's experts stacked; the FP8 stream's per-expert names write (and read)
    their rows, so an in-process FP8 push lands the dequantized experts there, and its weight_shapes (what `polyrl
    serve` checks announced names against) lists them."""
    from conftest import make_model_dir
    d = make_model_dir(tmp_path / "moe", arch="qwen3_moe", layers=2)
    eng = EmbeddedEngine(d)
    w = trainer_weights(d, 1)
    gu = "model.layers.1.mlp.experts.gate_up_proj"
    assert w[gu].dim() == 3 and "model.layers.1.mlp.experts.7.up_proj.weight" in eng.weight_shapes()
    FP8Transport(InMemoryTransport(1 << 12), in_process=True).push(iter(w.items()), eng, 1)
    I = w[gu].shape[1] // 2
    deq = lambda t: dequantize_fp8_block(*quantize_fp8_block(t))  # noqa: E731
    assert torch.equal(eng.get_weight(gu), torch.stack([torch.cat([deq(x[:I]), deq(x[I:])]) for x in w[gu]]))
    assert torch.equal(eng.get_weight("model.layers.1.mlp.experts.7.up_proj.weight"), deq(w[gu][7, I:]))
    assert torch.equal(eng.get_weight("model.layers.0.mlp.gate.weight"), w["model.layers.0.mlp.gate.weight"])


def test_quantize_runs_on_the_tensors_device_and_keeps_it():
    """GPU-capable: every op is a device op (no .cpu(), no Python loop over blocks)."""
    w = torch.randn(130, 260)
    q, s = quantize_fp8_block(w)
    assert q.device == w.device == s.device
    if torch.cuda.is_available():  # same bits on CUDA
        qc, sc = quantize_fp8_block(w.cuda())
        assert torch.equal(qc.cpu().view(torch.uint8), q.view(torch.uint8)) and torch.equal(sc.cpu(), s)


def test_dequantize_pairs_weights_and_scales_in_either_order_and_refuses_halves():
    w = {"a.q_proj.weight": torch.randn(130, 140), "b.o_proj.weight": torch.randn(64, 64), "n.norm.weight": torch.ones(3)}
    wire = list(quantize_stream(w.items()))
    for order in (wire, wire[::-1]):
        out = dict(dequantize_stream(order))
        assert out.keys() == w.keys()
        for n, t in w.items():
            assert torch.equal(out[n], dequantize_fp8_block(*quantize_fp8_block(t)) if is_quantized_weight(n, t) else t)
    with pytest.raises(ValueError, match="a.q_proj.weight without its weight_scale_inv"):
        list(dequantize_stream(wire[:1]))
    with pytest.raises(ValueError, match=r"does not fit an FP8 weight of shape \(130, 140\)"):
        dequantize_fp8_block(wire[0][1], torch.ones(1, 1))


def trainer_weights(model_dir: str, step: int) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(step)
    return {n: p.detach() + 0.01 * step * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def test_in_process_push_loads_the_dequantized_weights_and_counts_fp8_bytes(tiny_model):
    eng = EmbeddedEngine(tiny_model)
    w = trainer_weights(tiny_model, 3)
    moved = FP8Transport(InMemoryTransport(1 << 12), in_process=True).push(iter(w.items()), eng, 3)
    assert eng.version == 3
    want = dict(dequantize_stream(quantize_stream(w.items())))
    assert all(torch.equal(eng.get_weight(n), want[n]) for n in w)
    assert moved == sum(t.numel() * t.element_size() for _, t in quantize_stream(w.items()))


@pytest.mark.slow
def test_server_gets_the_same_dequantized_weights_as_in_process(tiny_model, tmp_path):
    """DistributedTransport over gloo (small buckets, so a weight and its scale land in different buckets, and buckets
    of one dtype go flattened) and DiskTransport into a `polyrl serve` on loopback; each read back bit for bit equal to
    what the in-process push loads, and --check-weight-update-equal passes on the FP8 stream."""
    from serve_procs import serving
    from test_distributed import FakeEngine

    weights_dir = tmp_path / "weights"
    weights_dir.mkdir()
    with serving(tiny_model, tmp_path, 1, "--allowed-weight-dirs", str(weights_dir)) as (srv,):
        eng = FakeEngine([srv.url])
        local = EmbeddedEngine(tiny_model)
        pushes = [(FP8Transport(DistributedTransport(1 << 12, device="cpu", timeout_s=120, check_equal=True),
                                in_process=False), 1),
                  (FP8Transport(DiskTransport(1 << 14, check_equal=True, dir=str(weights_dir), timeout_s=120),
                                in_process=False), 2)]
        try:
            for tr, step in pushes:
                w = trainer_weights(tiny_model, step)
                nbytes = tr.push(iter(w.items()), eng, step)
                FP8Transport(InMemoryTransport(1 << 20), in_process=True).push(iter(w.items()), local, step)
                assert nbytes == sum(t.numel() * t.element_size() for _, t in quantize_stream(w.items()))
                for n in w:
                    got = decode_tensor(eng.http.call(srv.url, "/get_weights_by_name",
                                                      {"name": n, "return_format": "base64"}, timeout=30))
                    assert torch.equal(got, local.get_weight(n)), (type(tr.inner).__name__, n)
                    if is_quantized_weight(n, w[n]):
                        assert not torch.equal(got, w[n])  # FP8-rounded, not the trainer's FP32
                check_weights_equal(eng.http, [srv.url], list(quantize_stream(w.items())))
            assert math.isclose(eng.pushed[-1][0], 2)
        finally:
            pushes[0][0].inner.close()
            eng.http.close()
