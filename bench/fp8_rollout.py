"""FP8 rollout on the GPU engine (--rollout-quantization fp8) against BF16, in one process on one GPU.

Qwen2.5 shapes from their configs with random weights generated on the GPU (nothing written to disk: a 7B checkpoint
would take minutes to write and read back); random weights sample degenerate text, so every sequence decodes exactly
--new-tokens tokens (ignore-EOS), temperature 1. Per shape:
  kernels   each decoder linear of one layer at M = 64, 256 (decode) and 8192 (prefill): the path fp8.kernel_config
            picks per mode (Triton kernel, cuBLAS block-scaled FP8 GEMM, or the dequantized weight through cuBLAS),
            cuBLAS's block-scaled GEMM alone, and BF16 F.linear (cuBLAS); microseconds and weight bytes per us
  rollout   BF16 engine vs the FP8 engine in each mode (fp8-w8a16, fp8-w8a8), B prompts x --prompt-len tokens +
            --new-tokens, B in --batches: tokens/s end to end and over decode steps, the prefill's seconds, and the
            share of the HBM roofline: per decode step the weights once (FP8 linears at 1 byte plus their float32
            scales; an untied embedding is not read) plus every live sequence's KV cache so far, at --hbm-tbps
  sync      update_weights of the whole model from GPU BF16 tensors: plain (BF16 engine) and through FP8Transport
            (quantized on the GPU, taken as FP8 by the FP8 engine)
Optionally (--baseline-0.5b) the BF16 engine at the regression gate's rollout setting (Qwen2.5-0.5B shape,
256 x (128 + 512)), to compare with bench/regress_baseline.json.

  python bench/fp8_rollout.py --shapes qwen2.5-1.5b,qwen2.5-7b --out runs/bench/fp8_rollout.json
  python bench/fp8_rollout.py --sweep --out runs/bench/fp8_sweep.json   # launch settings (fp8.TILES), see sweep()
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN_SHAPES, char_tokenizer, fmt, markdown_table, write_json  # noqa: E402


VARIANTS = ("none", "fp8-w8a16", "fp8-w8a8")  # the engine's FP8 modes (triton_ops.FP8_MODE), each set per variant
KV8 = "+kv8"  # a variant's suffix: the KV cache in FP8 (--kv-cache-dtype fp8_e4m3)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen2.5-1.5b,qwen2.5-7b")
    p.add_argument("--batches", default="64,256")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--mem-fraction", type=float, default=0.45)
    p.add_argument("--hbm-tbps", type=float, default=3.35, help="HBM bandwidth for the roofline (H100 SXM: 3.35)")
    p.add_argument("--baseline-0.5b", dest="baseline", action="store_true")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"engines to compare, the first is the baseline: {', '.join(VARIANTS)}, each optionally with "
                        f"'{KV8}' (the KV cache in FP8 E4M3, --kv-cache-dtype fp8_e4m3)")
    p.add_argument("--sweep", action="store_true",
                   help="instead of the rollout table: the FP8 linear kernels' launch settings and paths, per matrix of "
                        "--shapes (see sweep())")
    p.add_argument("--sweep-m", default="64,256", help="--sweep: token counts of the Triton tile sweep (decode sizes)")
    p.add_argument("--sweep-large-m", default="256,512,1024,2048,8192,16384",
                   help="--sweep: token counts of the large-M comparison (prefill: B x --prompt-len, in chunks of 16384)")
    p.add_argument("--sweep-jobs", type=int, default=12, help="--sweep: processes compiling the Triton variants first")
    p.add_argument("--sweep-budget-s", type=float, default=240.0,
                   help="--sweep: stop starting new tile sweeps after this many seconds (what ran is reported)")
    p.add_argument("--out", default="runs/bench/fp8_rollout.json")
    return p.parse_args(argv)


def model_dir(shape: str) -> str:
    """config.json + tokenizer only; the weights come from random_weights()."""
    from transformers import Qwen2Config
    d = tempfile.mkdtemp(prefix=f"fp8_{shape}_")
    s = QWEN_SHAPES[shape]
    tok = char_tokenizer(s["vocab_size"], d)
    Qwen2Config(**s, max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
                head_dim=s["hidden_size"] // s["num_attention_heads"]).save_pretrained(d)
    return d


def random_weights(path: str, seed: int = 0) -> list:
    """The HF-named parameters of the checkpoint's architecture, random BF16 on the GPU (norms 1, the rest N(0, 0.02))."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for n, p in m.named_parameters():
        if p.dim() == 1 and "norm" in n:
            out.append((n, torch.ones(p.shape, dtype=torch.bfloat16, device="cuda")))
        else:
            out.append((n, (torch.randn(p.shape, generator=g, device="cuda", dtype=torch.float32) * 0.02).to(torch.bfloat16)))
    return out


def engine(path: str, weights: list, quantization: str, a, max_batch: int):
    """quantization: none | fp8-w8a16 (weight-only FP8) | fp8-w8a8 (activations quantized too): triton_ops.FP8_MODE;
    a KV8 suffix: the FP8 KV cache."""
    import polyrl.rollout.gpu.engine as E
    from polyrl.rollout.gpu import triton_ops
    kv = "fp8_e4m3" if quantization.endswith(KV8) else "auto"
    quantization = quantization.removesuffix(KV8)
    if quantization.startswith("fp8-"):
        triton_ops.FP8_MODE = quantization[4:]
    quantization = "fp8" if quantization.startswith("fp8") else quantization
    orig = E.iter_checkpoint
    E.iter_checkpoint = lambda _p: iter(weights)  # noqa: E731  (the engine loads the GPU tensors instead of files)
    try:
        return E.GPUEngine(path, dtype=__import__("torch").bfloat16, max_batch=max_batch, mem_fraction=a.mem_fraction,
                           ignore_eos=True, profile=True, quantization=quantization, kv_cache_dtype=kv)
    finally:
        E.iter_checkpoint = orig


def weight_bytes_read(eng) -> int:
    """Bytes of weights one decode step reads: the whole buffer, less an untied embedding (only B rows of it)."""
    m = eng.model
    emb = 0 if eng.spec.tied else m.w["embed"].numel() * m.w["embed"].element_size()
    return m.nbytes - emb


def rollout(eng, B: int, a) -> dict:
    import torch

    from polyrl.types import SamplingParams
    g = torch.Generator().manual_seed(B)
    prompts = torch.randint(20, eng.spec.vocab, (B, a.prompt_len), generator=g).tolist()
    eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=4, seed=1))  # compile + capture bucket B
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=a.new_tokens, seed=0))
    dt = time.perf_counter() - t
    assert all(len(s.response_ids) == a.new_tokens for s in out)
    st = eng.last_stats
    s = eng.spec
    kv_tok = 2 * s.layers * s.kv_heads * (s.head_dim + 4 if eng.kv.fp8 else s.head_dim * 2)  # FP8: 1 byte + scales
    w = weight_bytes_read(eng)
    steps = a.new_tokens - 1
    total = sum(w + B * (a.prompt_len + k) * kv_tok for k in range(1, a.new_tokens))
    roof_s = total / (a.hbm_tbps * 1e12)
    return {"B": B, "tok_s": B * a.new_tokens / dt, "wall_s": dt, "decode_s": st["decode_s"],
            "decode_tok_s": B * steps / st["decode_s"], "gpu_decode_s": st.get("gpu_decode_s"),
            "weights_read_bytes": w, "roofline_decode_s": roof_s,
            "roofline_share_decode": roof_s / st["decode_s"], "roofline_share_end_to_end": roof_s / dt,
            "prefill_s": st["prefill_s"]}


def kernels(Lb: dict, eng_fp8, Ms=(64, 256, 8192)) -> list[dict]:
    """One layer's four linears (Lb: the BF16 engine's layer-0 tensors), the FP8 paths fp8.kernel_config picks
    (w8a16, w8a8) vs cuBLAS BF16, each cycling through copies of the matrix larger than L2 (as a decode step reads
    every layer's weights from HBM): decode sizes as 20 calls captured in a CUDA graph, prefill sizes (M > 512) eager."""
    import torch
    import torch.nn.functional as F

    from polyrl.rollout.gpu import fp8 as L
    from polyrl.rollout.gpu import triton_ops
    rows = []
    L8 = eng_fp8.model.layers[0]
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
    for key in ("qkv_w", "o_w", "gu_w", "down_w"):
        N, K = Lb[key].shape
        n8, n16 = max(2, -(-3 * l2 // (N * K))), max(2, -(-3 * l2 // (2 * N * K)))
        w8s = [L8[key].clone() for _ in range(n8)]
        s8s = [L8[key + ".s"].clone() for _ in range(n8)]
        wbs = [Lb[key].clone() for _ in range(n16)]
        rd = eng_fp8.model.row_div[key]
        for M in Ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            timer = graph_us if M <= 512 else eager_us
            res = {"bf16": timer(lambda i: F.linear(x, wbs[i]), n16)}
            for mode in ("w8a16", "w8a8"):
                res[mode] = timer(lambda i: triton_ops.fp8_linear(x, w8s[i], s8s[i], None, rd, mode=mode), n8)
            res["cublas_w8a8"] = None  # cuBLAS's block-scaled GEMM at this size, whichever path the engine takes
            if triton_ops.blockwise_mm_available(x.device) and L.scaled_mm_fits(N, K, rd):
                res["cublas_w8a8"] = timer(lambda i: triton_ops.fp8_linear(x, w8s[i], s8s[i], None, rd,
                                                                           {"path": "scaled_mm"}, "w8a8"), n8)
            paths = {m: L.kernel_config(M, N, K, 132, m, rd, triton_ops.blockwise_mm_available(x.device))["path"]
                     for m in ("w8a16", "w8a8")}
            nb8 = w8s[0].numel() + s8s[0].numel() * 4
            rows.append({"matrix": key, "N": N, "K": K, "M": M, "bf16_us": res["bf16"], "w8a16_us": res["w8a16"],
                         "w8a8_us": res["w8a8"], "cublas_w8a8_us": res["cublas_w8a8"], "paths": paths,
                         "bf16_GBps": wbs[0].numel() * 2 / res["bf16"] / 1e3,
                         "w8a16_GBps": nb8 / res["w8a16"] / 1e3, "w8a8_GBps": nb8 / res["w8a8"] / 1e3})
            del x
        del w8s, s8s, wbs
    return rows


def sync(eng, weights, fp8: bool) -> dict:
    import torch

    from polyrl.weight_sync import FP8Transport, InMemoryTransport
    t = FP8Transport(InMemoryTransport(), in_process=True) if fp8 else InMemoryTransport()
    t.push(iter(weights), eng, 1)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    moved = t.push(iter(weights), eng, 2)
    torch.cuda.synchronize()
    return {"s": time.perf_counter() - t0, "bytes": moved}


# ---- --sweep: the FP8 linears alone ------------------------------------------------------------------------------
def linear_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """(N, K) of the engine's four decoder linears for a QWEN_SHAPES entry (fused q|k|v and gate|up)."""
    s = QWEN_SHAPES[shape]
    h, inter = s["hidden_size"], s["intermediate_size"]
    d = h // s["num_attention_heads"]
    q, kv = s["num_attention_heads"] * d, s["num_key_value_heads"] * d
    return {"qkv_w": (q + 2 * kv, h), "o_w": (h, q), "gu_w": (2 * inter, h), "down_w": (h, inter)}


def weight_copies(N: int, K: int) -> tuple[list, list, list]:
    """(FP8 weights, their scales, BF16 weights): enough copies of one random matrix that calls cycling through them
    read it from HBM, not from L2 (as a decode step does, which reads every layer's weights once)."""
    import torch

    from polyrl.weight_sync.quantize import quantize_fp8_block
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
    w = (torch.randn(N, K, device="cuda") * 0.02).to(torch.bfloat16)
    q, s = quantize_fp8_block(w)
    n8, n16 = max(2, -(-3 * l2 // (N * K))), max(2, -(-3 * l2 // (2 * N * K)))
    return [q.clone() for _ in range(n8)], [s.clone() for _ in range(n8)], [w.clone() for _ in range(n16)]


def graph_us(make, n: int, iters: int = 20, reps: int = 3) -> float:
    """Microseconds per call: `iters` calls of make(i % n) captured in one CUDA graph (no launch gaps, as in the
    engine's decode step), best of `reps` replays."""
    import torch
    from polyrl.rollout.gpu.graphs import capture
    g, _ = capture(lambda: [make(i % n) for i in range(iters)], warmup=lambda: [make(i) for i in range(min(n, 2))])
    g.replay()
    best = float("inf")
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        best = min(best, e0.elapsed_time(e1) * 1e3 / iters)
    del g
    torch.cuda.empty_cache()  # the graph's private pool (thousands of graphs in a sweep)
    return best


def eager_us(make, n: int, iters: int = 5) -> float:
    """Microseconds per call, eager (large M: launch time is noise), after two warm-up calls."""
    import torch
    for i in range(2):
        make(i % n)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for i in range(iters):
        make(i % n)
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) * 1e3 / iters


def probe_scaled_mm() -> dict:
    """What the installed torch's block-scaled FP8 GEMM accepts here (1x128 activation scales, 128x128 weight
    scales), at the shapes the engine would give it, and how far it lands from the float64 product of the same
    quantized operands (relative to sum |x| |w|)."""
    import torch
    import torch.nn.functional as F

    from polyrl.rollout.gpu import triton_ops
    from polyrl.weight_sync.quantize import quantize_fp8_block
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "capability": list(torch.cuda.get_device_capability()),
           "has_F.scaled_mm": hasattr(F, "scaled_mm"), "has_torch._scaled_mm": hasattr(torch, "_scaled_mm"),
           "blockwise_mm_available": triton_ops.blockwise_mm_available(torch.device("cuda")), "cases": []}
    try:
        import triton
        out["triton"] = triton.__version__
    except ImportError:
        pass
    for M, N, K in ((256, 4608, 3584), (8192, 3584, 18944), (8191, 2048, 1536), (1100, 1536, 8960), (64, 768, 512),
                    (8192, 320, 200)):
        w = torch.randn(N, K, device="cuda") * 0.02
        q, s = quantize_fp8_block(w)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        xq, xs = triton_ops.quantize_activations(x, group_major=True)
        ref = (xq.double() * xs.double().repeat_interleave(128, 1)[:, :K]) @ (
            q.double() * s.double().repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]).t()
        mag = (x.double().abs() @ (q.double().abs() * s.double().repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]).t())
        bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        for name, fn in (
                ("F.scaled_mm bf16", lambda: triton_ops.blockwise_mm(xq, xs, q, s, torch.bfloat16)),
                ("F.scaled_mm fp32", lambda: triton_ops.blockwise_mm(xq, xs, q, s, torch.float32)),
                ("F.scaled_mm bf16 +bias", lambda: F.scaled_mm(xq, q.t(), xs, F.ScalingType.BlockWise1x128, s.t(),
                                                              F.ScalingType.BlockWise128x128, bias=bias,
                                                              output_dtype=torch.bfloat16) - bias),
                ("torch._scaled_mm bf16", lambda: torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s.t(),
                                                                  out_dtype=torch.bfloat16))):
            case = {"M": M, "N": N, "K": K, "call": name}
            try:
                y = fn()
                torch.cuda.synchronize()
                case["ok"] = True
                case["rel_err"] = ((y.double() - ref).abs() / mag.clamp(min=1e-30)).max().item()
            except Exception as e:  # noqa: BLE001  (a probe: every refusal is a finding)
                case["ok"] = False
                case["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            out["cases"].append(case)
    try:  # captured in a CUDA graph
        w = torch.randn(4608, 3584, device="cuda") * 0.02
        q, s = quantize_fp8_block(w)
        x = torch.randn(256, 3584, device="cuda", dtype=torch.bfloat16)
        eager = triton_ops.fp8_linear(x, q, s, config={"path": "scaled_mm"}, mode="w8a8")
        out["graph_us"] = graph_us(lambda i: triton_ops.fp8_linear(x, q, s, config={"path": "scaled_mm"}, mode="w8a8"), 1)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = triton_ops.fp8_linear(x, q, s, config={"path": "scaled_mm"}, mode="w8a8")
        g.replay()
        torch.cuda.synchronize()
        out["graph_equal_eager"] = bool(torch.equal(y, eager))
    except Exception as e:  # noqa: BLE001
        out["graph_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def decode_tiles(M: int) -> list[tuple[int, int, int, int, int]]:
    """(BM, BN, BK, num_warps, num_stages) the decode sweep tries at M tokens."""
    if M <= 128:
        bm = max(16, 1 << (M - 1).bit_length())
        return [(bm, bn, 128, w, st) for bn in (64, 128) for w in (4, 8) for st in (3, 5)]
    return [(bm, bn, 128, w, st) for bm, bn in ((64, 64), (128, 64), (256, 64), (64, 128), (128, 128))
            for w in (4, 8) for st in (3, 4)]


def _warm_kernels(jobs: list) -> int:
    """Compile (by launching once on a small problem) the Triton kernels of `jobs` [(mode, config)], in a worker
    process: the compiled kernels land in Triton's on-disk cache, where the sweep's own launches find them. Every
    sweep shape has N, K, M and strides divisible by 16, so a small problem of the same kind specializes alike."""
    import torch

    from polyrl.rollout.gpu import triton_ops as T
    from polyrl.weight_sync.quantize import quantize_fp8_block
    q, s = quantize_fp8_block(torch.randn(256, 512, device="cuda"))
    done = 0
    for M, mode, cfg in jobs:
        x = torch.randn(M, 512, device="cuda", dtype=torch.bfloat16)
        try:
            T.fp8_linear(x, q, s, config=cfg, mode=mode)
            done += 1
        except Exception:  # noqa: BLE001  (the sweep itself records the failure)
            pass
    torch.cuda.synchronize()
    return done


def warm_in_parallel(jobs: list, workers: int):
    """Start compiling `jobs` in `workers` processes (one compile uses one core; the sweep needs ~200); call the
    result to wait for them."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    t = time.perf_counter()
    ex = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"))
    futures = [ex.submit(_warm_kernels, jobs[i::workers]) for i in range(workers)]

    def wait() -> dict:
        done = sum(f.result() for f in futures)
        ex.shutdown()
        return {"kernels": len(jobs), "compiled": done, "s": time.perf_counter() - t}
    return wait


def sweep(a) -> dict:
    """Per matrix of each shape: (1) large M (prefill): cuBLAS BF16 vs the FP8 paths (dequantize + cuBLAS, cuBLAS's
    block-scaled FP8 GEMM, Triton tiles); (2) decode M: every Triton tile of decode_tiles x K splits, for w8a16,
    w8a8 with the activations quantized by their own launch and w8a8 quantizing them in the kernel (quant_x), beside
    the current kernel_config and cuBLAS BF16. Weights cycle through copies larger than L2."""
    import torch
    import torch.nn.functional as F

    from polyrl.rollout.gpu import fp8 as L
    from polyrl.rollout.gpu import triton_ops as T
    t_start = time.perf_counter()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res: dict = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "args": vars(a),
                 "probe": probe_scaled_mm(), "large": [], "decode": [], "skipped": []}
    print(json.dumps(res["probe"], indent=1), flush=True)
    plan = []  # every compiled variant of the decode sweep, once (one launch setting each)
    for M in (int(m) for m in a.sweep_m.split(",")):
        for bm, bn, bk, w, st in decode_tiles(M):
            for sp in (1, 2):
                for mode, qx in (("w8a16", False), ("w8a8", False), ("w8a8", True)):
                    plan.append((M, mode, L.tile_config(M, 256 * bn, 512 * sp, bm, bn, bk, w, st, sp, qx)))
    warm = warm_in_parallel(plan, a.sweep_jobs)
    bw = T.blockwise_mm_available(torch.device("cuda"))
    shapes = a.shapes.split(",")
    # (1) large M
    for shape in shapes:
        for key, (N, K) in linear_shapes(shape).items():
            qs, ss, ws = weight_copies(N, K)
            n8, n16 = len(qs), len(ws)
            for M in (int(m) for m in a.sweep_large_m.split(",")):
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                row = {"shape": shape, "matrix": key, "N": N, "K": K, "M": M}
                cands = {"bf16": (lambda i: F.linear(x, ws[i]), n16),
                         "dequant_only": (lambda i: T.fp8_dequantize(qs[i], ss[i]), n8),
                         "dequant": (lambda i: T.fp8_linear(x, qs[i], ss[i], config={"path": "dequant"}), n8)}
                if bw:
                    cands["scaled_mm"] = (lambda i: T.fp8_linear(x, qs[i], ss[i], config={"path": "scaled_mm"},
                                                                 mode="w8a8"), n8)
                if M <= 8192:
                    for bm, bn, bk, w, st in ((128, 128, 128, 8, 3), (256, 128, 128, 8, 3), (128, 128, 128, 4, 4)):
                        c = L.tile_config(M, N, K, bm, bn, bk, w, st)
                        cands[f"triton_w8a8_{bm}x{bn}x{bk}_w{w}s{st}"] = (
                            lambda i, c=c: T.fp8_linear(x, qs[i], ss[i], config=c, mode="w8a8"), n8)
                    c = L.tile_config(M, N, K, 128, 128, 64, 8, 3)
                    cands["triton_w8a16_128x128x64_w8s3"] = (lambda i, c=c: T.fp8_linear(x, qs[i], ss[i], config=c,
                                                                                          mode="w8a16"), n8)
                for name, (fn, n) in cands.items():
                    try:
                        eager = M > 512 or (name == "scaled_mm" and "graph_error" in res["probe"])
                        row[name] = eager_us(fn, n) if eager else graph_us(fn, n)
                    except Exception as e:  # noqa: BLE001  (a sweep: a failing candidate is a finding)
                        row[name] = None
                        row[name + "_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                res["large"].append(row)
                print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
                del x
            del qs, ss, ws
            torch.cuda.empty_cache()
        write_json(a.out, res)
    # (2) decode M: Triton tiles x splits (compiled in parallel meanwhile)
    res["warm"] = warm()
    print("warm-up compile:", res["warm"], flush=True)
    for M in (int(m) for m in a.sweep_m.split(",")):
        for shape in shapes:
            for key, (N, K) in linear_shapes(shape).items():
                if time.perf_counter() - t_start > a.sweep_budget_s:
                    res["skipped"].append([shape, key, M])
                    continue
                qs, ss, ws = weight_copies(N, K)
                n8, n16 = len(qs), len(ws)
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                row = {"shape": shape, "matrix": key, "N": N, "K": K, "M": M,
                       "bf16": graph_us(lambda i: F.linear(x, ws[i]), n16), "runs": []}
                for mode in ("w8a16", "w8a8"):
                    c = L.kernel_config(M, N, K, sms, mode)
                    row[f"default_{mode}"] = graph_us(lambda i, c=c: T.fp8_linear(x, qs[i], ss[i], config=c, mode=mode), n8)
                for bm, bn, bk, w, st in decode_tiles(M):
                    tiles = -(-M // bm) * -(-N // bn)
                    k_iters = -(-K // bk)
                    auto = L.auto_split(M, N, K, bm, bn, bk, sms)
                    splits = sorted({sp for sp in (1, 2, 3, 4, 6, 8, auto)
                                     if sp == 1 or (k_iters // sp >= 2 and tiles * sp <= 6 * sms)})
                    for sp in splits:
                        for variant, mode, qx in (("w8a16", "w8a16", False), ("w8a8", "w8a8", False),
                                                  ("w8a8q", "w8a8", True)):
                            c = L.tile_config(M, N, K, bm, bn, bk, w, st, sp, qx)
                            run = {"v": variant, "BM": bm, "BN": bn, "BK": bk, "w": w, "st": st, "split": c["split"],
                                   "auto": sp == auto}
                            try:
                                run["us"] = graph_us(lambda i, c=c: T.fp8_linear(x, qs[i], ss[i], config=c, mode=mode), n8)
                            except Exception as e:  # noqa: BLE001
                                run["us"] = None
                                run["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                            row["runs"].append(run)
                ok = [r for r in row["runs"] if r["us"] is not None]
                for v in ("w8a16", "w8a8", "w8a8q"):
                    best = min((r for r in ok if r["v"] == v), key=lambda r: r["us"], default=None)
                    row[f"best_{v}"] = best
                res["decode"].append(row)
                bb = {v: row[f"best_{v}"] for v in ("w8a16", "w8a8", "w8a8q")}
                print(f"{shape} {key} {N}x{K} M={M}: bf16 {row['bf16']:.1f} us, default w8a16 {row['default_w8a16']:.1f} "
                      f"w8a8 {row['default_w8a8']:.1f}; best " + "; ".join(
                          f"{v} {b['us']:.1f} ({b['BM']}x{b['BN']}x{b['BK']} w{b['w']} s{b['st']} split {b['split']})"
                          for v, b in bb.items() if b), flush=True)
                del qs, ss, ws, x
                torch.cuda.empty_cache()
                write_json(a.out, res)
    summarize_sweep(res)
    write_json(a.out, res)
    return res


def summarize_sweep(res: dict) -> None:
    """Print, per (shape, M, variant), the tiles whose per-matrix best split gives the least total time over the four
    matrices (one layer), with the total at the auto split rule beside it."""
    from collections import defaultdict
    tot: dict = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0, 0]))
    base: dict = defaultdict(lambda: defaultdict(float))
    for row in res["decode"]:
        k = (row["shape"], row["M"])
        base[k]["bf16"] += row["bf16"]
        base[k]["default_w8a16"] += row["default_w8a16"]
        base[k]["default_w8a8"] += row["default_w8a8"]
        per: dict = {}
        for r in row["runs"]:
            if r["us"] is None:
                continue
            t = (r["v"], r["BM"], r["BN"], r["BK"], r["w"], r["st"])
            best, auto = per.get(t, (float("inf"), None))
            per[t] = (min(best, r["us"]), r["us"] if r["auto"] else auto)
        for t, (best, auto) in per.items():
            acc = tot[k][t]
            acc[0] += best
            acc[1] += auto if auto is not None else float("nan")
            acc[2] += 1
    for k in sorted(tot):
        print(f"== {k[0]} M={k[1]}: one layer's four linears, us: " + ", ".join(f"{n} {v:.1f}" for n, v in base[k].items()))
        for v in ("w8a16", "w8a8", "w8a8q"):
            items = sorted(((t, s) for t, s in tot[k].items() if t[0] == v and s[2] == 4), key=lambda ts: ts[1][0])[:4]
            for t, (best, auto, _) in items:
                print(f"   {v:6s} BM {t[1]:3d} BN {t[2]:3d} BK {t[3]:3d} warps {t[4]} stages {t[5]}: best splits "
                      f"{best:.1f}, auto split {auto:.1f}")


def main(argv=None) -> dict:
    a = parse_args(argv)
    import torch
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    from polyrl.dist import set_host_threads
    set_host_threads("cuda", 1)  # as polyrl train and serve set them
    if a.sweep:
        return sweep(a)
    from polyrl.rollout.gpu import triton_ops
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": dict(vars(a)),
                 "date": time.strftime("%Y-%m-%d"), "fp8_default_mode": triton_ops.FP8_MODE, "shapes": {}}
    batches = [int(b) for b in a.batches.split(",")]
    rows, krows = [], []
    variants = a.variants.split(",")
    for shape in a.shapes.split(","):
        path = model_dir(shape)
        weights = random_weights(path)
        r = res["shapes"][shape] = {}
        keep = None
        for q in variants:
            t = time.perf_counter()
            eng = engine(path, weights, q, a, max(batches))
            torch.cuda.synchronize()
            r[q] = {"init_s": time.perf_counter() - t, "weights_bytes": eng.model.nbytes,
                    "weights_read_per_step": weight_bytes_read(eng), "kv_blocks": eng.alloc.num_blocks}
            r[q]["runs"] = [rollout(eng, B, a) for B in batches]
            r[q]["sync"] = sync(eng, weights, q.startswith("fp8"))
            if q == "none":  # keep the BF16 engine's layer-0 weights for the kernel table
                keep = {k: v.clone() for k, v in eng.model.layers[0].items()}
            elif q == "fp8-w8a8" and keep is not None:
                r["kernels"] = kernels(keep, eng)
            del eng
            gc.collect()
            torch.cuda.empty_cache()
            write_json(a.out, res)
        krows += [[shape, k["matrix"], f"{k['N']}x{k['K']}", k["M"], fmt(k["bf16_us"], "{:.1f}"),
                   f"{k['w8a16_us']:.1f} ({k['paths']['w8a16']})", f"{k['w8a8_us']:.1f} ({k['paths']['w8a8']})",
                   fmt(k["cublas_w8a8_us"], "{:.1f}"), fmt(k["bf16_GBps"], "{:.0f}"), fmt(k["w8a16_GBps"], "{:.0f}"),
                   fmt(k["w8a8_GBps"], "{:.0f}")] for k in r.get("kernels", [])]
        del weights, keep
        gc.collect()
        torch.cuda.empty_cache()
        for i, B in enumerate(batches):
            b16 = r[variants[0]]["runs"][i]
            for q in variants:
                f8 = r[q]["runs"][i]
                rows.append([shape, B, q, fmt(f8["tok_s"], "{:.0f}"), fmt(f8["tok_s"] / b16["tok_s"], "{:.2f}x"),
                             fmt(f8["decode_tok_s"], "{:.0f}"), fmt(f8["decode_tok_s"] / b16["decode_tok_s"], "{:.2f}x"),
                             fmt(100 * f8["roofline_share_decode"], "{:.0f}%"), fmt(f8["prefill_s"], "{:.3f}")])
        r["weights_gib"] = {q: r[q]["weights_bytes"] / 2**30 for q in variants}
        write_json(a.out, res)
    if a.baseline:  # the regression gate's rollout setting, BF16 engine (bench/regress_baseline.json)
        path = model_dir("qwen2.5-0.5b")
        weights = random_weights(path)
        eng = engine(path, weights, "none", a, 256)
        a.new_tokens = 512
        res["bf16_0.5b_256x(128+512)_tok_s"] = rollout(eng, 256, a)["tok_s"]
        del eng, weights
    print(f"engine FP8 default mode: {res['fp8_default_mode']}")
    print(markdown_table(["shape", "B", "engine", "tok/s", "vs BF16", "decode tok/s", "decode vs BF16",
                          "of HBM roofline (decode)", "prefill s"], rows))
    print(markdown_table(["shape", "matrix", "N x K", "M", "BF16 us", "w8a16 us (path)", "w8a8 us (path)",
                          "cuBLAS w8a8 us", "BF16 GB/s", "w8a16 GB/s", "w8a8 GB/s"], krows))
    for shape, r in res["shapes"].items():
        b0 = r[variants[0]]
        for q in variants[1:]:
            f8 = r[q]
            print(f"{shape} {q}: weights {r['weights_gib'][variants[0]]:.2f} GiB -> {r['weights_gib'][q]:.2f} GiB "
                  f"(KV blocks {b0['kv_blocks']} -> {f8['kv_blocks']}); weight sync {1e3 * b0['sync']['s']:.1f} ms "
                  f"({b0['sync']['bytes'] / 2**30:.2f} GiB) vs {1e3 * f8['sync']['s']:.1f} ms "
                  f"({f8['sync']['bytes'] / 2**30:.2f} GiB)")
    if "bf16_0.5b_256x(128+512)_tok_s" in res:
        print(f"BF16 0.5B 256 x (128 + 512): {res['bf16_0.5b_256x(128+512)_tok_s']:.0f} tok/s")
    write_json(a.out, res)
    return res


if __name__ == "__main__":
    main()
