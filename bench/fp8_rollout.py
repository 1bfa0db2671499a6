"""FP8 rollout on the GPU engine (--rollout-quantization fp8) against BF16, in one process on one GPU.

Qwen2.5 shapes from their configs with random weights generated on the GPU (nothing written to disk: a 7B checkpoint
would take minutes to write and read back); random weights sample degenerate text, so every sequence decodes exactly
--new-tokens tokens (ignore-EOS), temperature 1. Per shape:
  kernels   each decoder linear of one layer, FP8 Triton kernel vs BF16 F.linear (cuBLAS), at M = 64 and 256:
            microseconds and the weight bytes each moves per microsecond
  rollout   BF16 engine vs FP8 engine, B prompts x --prompt-len tokens + --new-tokens, B in --batches: tokens/s end
            to end and over decode steps, and the share of the HBM roofline: per decode step the weights once (FP8
            linears at 1 byte plus their float32 scales; an untied embedding is not read) plus every live sequence's
            KV cache so far, at --hbm-tbps
  sync      update_weights of the whole model from GPU BF16 tensors: plain (BF16 engine) and through FP8Transport
            (quantized on the GPU, taken as FP8 by the FP8 engine)
Optionally (--baseline-0.5b) the BF16 engine at the regression gate's rollout setting (Qwen2.5-0.5B shape,
256 x (128 + 512)), to compare with bench/regress_baseline.json.

  python bench/fp8_rollout.py --shapes qwen2.5-1.5b,qwen2.5-7b --out runs/bench/fp8_rollout.json
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN_SHAPES, char_tokenizer, fmt, markdown_table, write_json  # noqa: E402


VARIANTS = ("none", "fp8", "fp8-w8a8")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen2.5-1.5b,qwen2.5-7b")
    p.add_argument("--batches", default="64,256")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--mem-fraction", type=float, default=0.45)
    p.add_argument("--hbm-tbps", type=float, default=3.35, help="HBM bandwidth for the roofline (H100 SXM: 3.35)")
    p.add_argument("--baseline-0.5b", dest="baseline", action="store_true")
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
    """quantization: none | fp8 (w8a16 kernel) | fp8-w8a8 (activations quantized too: triton_ops.FP8_MODE)."""
    import polyrl.rollout.gpu.engine as E
    from polyrl.rollout.gpu import triton_ops
    triton_ops.FP8_MODE = "w8a8" if quantization == "fp8-w8a8" else "w8a16"
    quantization = "fp8" if quantization.startswith("fp8") else quantization
    orig = E.iter_checkpoint
    E.iter_checkpoint = lambda _p: iter(weights)  # noqa: E731  (the engine loads the GPU tensors instead of files)
    try:
        return E.GPUEngine(path, dtype=__import__("torch").bfloat16, max_batch=max_batch, mem_fraction=a.mem_fraction,
                           ignore_eos=True, profile=True, quantization=quantization)
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
    kv_tok = 2 * s.layers * s.kv_heads * s.head_dim * 2
    w = weight_bytes_read(eng)
    steps = a.new_tokens - 1
    total = sum(w + B * (a.prompt_len + k) * kv_tok for k in range(1, a.new_tokens))
    roof_s = total / (a.hbm_tbps * 1e12)
    return {"B": B, "tok_s": B * a.new_tokens / dt, "wall_s": dt, "decode_s": st["decode_s"],
            "decode_tok_s": B * steps / st["decode_s"], "gpu_decode_s": st.get("gpu_decode_s"),
            "weights_read_bytes": w, "roofline_decode_s": roof_s,
            "roofline_share_decode": roof_s / st["decode_s"], "roofline_share_end_to_end": roof_s / dt,
            "prefill_s": st["prefill_s"]}


def kernels(Lb: dict, eng_fp8, Ms=(64, 256)) -> list[dict]:
    """One layer's four linears (Lb: the BF16 engine's layer-0 tensors), FP8 kernels (w8a16, w8a8) vs cuBLAS BF16:
    20 calls captured in a CUDA graph (no launch overhead, as in decode), replayed 5 times."""
    import torch
    import torch.nn.functional as F

    from polyrl.rollout.gpu import triton_ops
    rows = []
    L8 = eng_fp8.model.layers[0]
    for key in ("qkv_w", "o_w", "gu_w", "down_w"):
        w8, s8, wb = L8[key], L8[key + ".s"], Lb[key]
        N, K = wb.shape
        for M in Ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            res = {}
            rd = eng_fp8.model.row_div[key]
            for name, fn in (("bf16", lambda: F.linear(x, wb)),
                             ("w8a16", lambda: triton_ops.fp8_linear(x, w8, s8, None, rd, mode="w8a16")),
                             ("w8a8", lambda: triton_ops.fp8_linear(x, w8, s8, None, rd, mode="w8a8"))):
                st = torch.cuda.Stream()
                st.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(st):
                    fn()
                torch.cuda.current_stream().wait_stream(st)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(20):
                        fn()
                g.replay()
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(5):
                    g.replay()
                e1.record()
                torch.cuda.synchronize()
                res[name] = e0.elapsed_time(e1) / 100 * 1e3  # us
                del g
            nb8 = w8.numel() + s8.numel() * 4
            rows.append({"matrix": key, "N": N, "K": K, "M": M, "bf16_us": res["bf16"], "w8a16_us": res["w8a16"],
                         "w8a8_us": res["w8a8"], "bf16_GBps": wb.numel() * 2 / res["bf16"] / 1e3,
                         "w8a16_GBps": nb8 / res["w8a16"] / 1e3, "w8a8_GBps": nb8 / res["w8a8"] / 1e3})
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


def main(argv=None) -> dict:
    a = parse_args(argv)
    import torch
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(a),
                 "date": time.strftime("%Y-%m-%d"), "shapes": {}}
    batches = [int(b) for b in a.batches.split(",")]
    rows, krows = [], []
    for shape in a.shapes.split(","):
        path = model_dir(shape)
        weights = random_weights(path)
        r = res["shapes"][shape] = {}
        for q in VARIANTS:
            t = time.perf_counter()
            eng = engine(path, weights, q, a, max(batches))
            torch.cuda.synchronize()
            r[q] = {"init_s": time.perf_counter() - t, "weights_bytes": eng.model.nbytes,
                    "weights_read_per_step": weight_bytes_read(eng), "kv_blocks": eng.alloc.num_blocks}
            r[q]["runs"] = [rollout(eng, B, a) for B in batches]
            r[q]["sync"] = sync(eng, weights, q != "none")
            if q == "none":  # keep the BF16 engine's layer-0 weights for the kernel table
                keep = {k: v.clone() for k, v in eng.model.layers[0].items()}
            elif q == "fp8":
                r["kernels"] = kernels(keep, eng)
            del eng
            gc.collect()
            torch.cuda.empty_cache()
            write_json(a.out, res)
        krows += [[shape, k["matrix"], f"{k['N']}x{k['K']}", k["M"], fmt(k["bf16_us"], "{:.1f}"),
                   fmt(k["w8a16_us"], "{:.1f}"), fmt(k["w8a8_us"], "{:.1f}"), fmt(k["bf16_GBps"], "{:.0f}"),
                   fmt(k["w8a16_GBps"], "{:.0f}"), fmt(k["w8a8_GBps"], "{:.0f}")] for k in r["kernels"]]
        del weights, keep
        gc.collect()
        torch.cuda.empty_cache()
        for i, B in enumerate(batches):
            b16 = r["none"]["runs"][i]
            for q in VARIANTS:
                f8 = r[q]["runs"][i]
                rows.append([shape, B, q, fmt(f8["tok_s"], "{:.0f}"), fmt(f8["tok_s"] / b16["tok_s"], "{:.2f}x"),
                             fmt(f8["decode_tok_s"], "{:.0f}"), fmt(f8["decode_tok_s"] / b16["decode_tok_s"], "{:.2f}x"),
                             fmt(100 * f8["roofline_share_decode"], "{:.0f}%")])
        r["weights_gib"] = {q: r[q]["weights_bytes"] / 2**30 for q in ("none", "fp8")}
        write_json(a.out, res)
    if a.baseline:  # the regression gate's rollout setting, BF16 engine (bench/regress_baseline.json)
        path = model_dir("qwen2.5-0.5b")
        weights = random_weights(path)
        eng = engine(path, weights, "none", a, 256)
        a.new_tokens = 512
        res["bf16_0.5b_256x(128+512)_tok_s"] = rollout(eng, 256, a)["tok_s"]
        del eng, weights
    print(markdown_table(["shape", "B", "engine", "tok/s", "vs BF16", "decode tok/s", "decode vs BF16",
                          "of HBM roofline (decode)"], rows))
    print(markdown_table(["shape", "matrix", "N x K", "M", "BF16 us", "w8a16 us", "w8a8 us", "BF16 GB/s", "w8a16 GB/s",
                          "w8a8 GB/s"], krows))
    for shape, r in res["shapes"].items():
        print(f"{shape}: weights {r['weights_gib']['none']:.2f} GiB BF16 -> {r['weights_gib']['fp8']:.2f} GiB FP8 "
              f"(KV blocks {r['none']['kv_blocks']} -> {r['fp8']['kv_blocks']}); weight sync {1e3 * r['none']['sync']['s']:.1f} ms "
              f"BF16 ({r['none']['sync']['bytes'] / 2**30:.2f} GiB) vs {1e3 * r['fp8']['sync']['s']:.1f} ms with FP8 "
              f"quantization ({r['fp8']['sync']['bytes'] / 2**30:.2f} GiB)")
    if "bf16_0.5b_256x(128+512)_tok_s" in res:
        print(f"BF16 0.5B 256 x (128 + 512): {res['bf16_0.5b_256x(128+512)_tok_s']:.0f} tok/s")
    write_json(a.out, res)
    return res


if __name__ == "__main__":
    main()
