"""Decode throughput of the embedded engine's GPU path on a Qwen3-MoE shape vs transformers `generate`.

A Qwen3-MoE-shaped model (bench/common.py QWEN3_MOE_SHAPES, random BF16 weights) on one GPU, ignore-EOS semantics
(every sequence decodes exactly --new-tokens; transformers gets min_new_tokens = max_new_tokens), temperature 1.

  engine          polyrl GPU engine (CUDA graphs, torch grouped GEMM experts), after a warm-up call
  engine+routes   the same with return_routed_experts (R3's per-token routes copied to the host every step)
  engine fp8-*    with --quantization: the engine with FP8 linears and experts (--rollout-quantization fp8) in a
                  mode of triton_ops.FP8_MODE (the experts are weight-only in both), same prompts, same call
  hf              transformers generate (dynamic cache, its default experts implementation)
  --experts-sweep one MoE layer's experts (route, sort, gate|up, SiLU, down) at T tokens for the shape and for
                  Qwen3-30B-A3B's expert dims: BF16 (torch grouped GEMM), the grouped FP8 kernel, and the FP8 experts
                  dequantized for torch's grouped GEMM (the prefill path): microseconds under a CUDA graph

  PYTHONPATH=. python3 bench/moe_rollout.py --out runs/bench/moe_rollout.json
  PYTHONPATH=. python3 bench/moe_rollout.py --quantization none,fp8-w8a16,fp8-w8a8 --experts-sweep --hf-new-tokens 0
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN3_MOE_SHAPES, build_model_dir, fmt, markdown_table, write_json  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-moe-1b", choices=sorted(QWEN3_MOE_SHAPES))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--hf-new-tokens", type=int, default=64, help="new tokens for the transformers baseline (0: skip it)")
    p.add_argument("--mem-fraction", type=float, default=0.4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="runs/bench/moe_rollout.json")
    p.add_argument("--model-dir", default=None, help="reuse a model directory (default: a fresh temporary one)")
    p.add_argument("--quantization", default="none",
                   help="comma list of engine variants: none, fp8-w8a16, fp8-w8a8 (--rollout-quantization fp8 in that "
                        "triton_ops.FP8_MODE)")
    p.add_argument("--experts-sweep", action="store_true", help="time one layer's experts per path (see above)")
    p.add_argument("--sweep-only", action="store_true", help="--experts-sweep without the rollout table")
    p.add_argument("--sweep-tokens", default="1,8,64,128,256,512,1024,4096")
    return p.parse_args(argv)


# Qwen3-30B-A3B's experts (its config.json): hidden 2048, 128 experts of width 768, top-8
EXPERT_DIMS = {"qwen3-30b-a3b": dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8)}


def experts_sweep(shape: dict, tokens: list[int]) -> list[dict]:
    """Microseconds of one layer's experts at T tokens (random BF16 activations, router and experts; CUDA graph of 20
    calls, best of 3): BF16 experts, FP8 experts by the grouped FP8 kernel, FP8 experts dequantized for the grouped
    BF16 GEMM."""
    import torch

    from polyrl.rollout.gpu import fp8 as F8
    from polyrl.rollout.gpu import triton_ops as T
    from polyrl.rollout.gpu.graphs import capture
    from polyrl.weight_sync.quantize import quantize_fp8_block
    H, I, E, k = (shape[n] for n in ("hidden_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok"))
    g = torch.Generator(device="cuda").manual_seed(0)
    router = (torch.randn(E, H, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    gu = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * H ** -0.5).to(torch.bfloat16)
    dn = (torch.randn(E, H, I, device="cuda", generator=g) * I ** -0.5).to(torch.bfloat16)
    (gq, gs), (dq, ds) = quantize_fp8_block(gu), quantize_fp8_block(dn)
    rows = []
    saved = F8.EXPERTS_DEQUANT_MIN_ROWS
    try:
        for t in tokens:
            x = torch.randn(t, H, device="cuda", generator=g).to(torch.bfloat16)
            row = {"tokens": t, "rows": t * k}
            for name, thresh, fn in (("bf16", None, lambda: T.moe_experts(x, gu, dn, *T.moe_route(x, router, k, True))),
                                     ("fp8_kernel", 1 << 62, None), ("fp8_dequant", 0, None)):
                if thresh is not None:
                    F8.EXPERTS_DEQUANT_MIN_ROWS = thresh
                    fn = lambda: T.moe_experts(x, gq, dq, *T.moe_route(x, router, k, True),  # noqa: E731
                                               scales=(gs, 128, ds, 128))
                fn()
                graph, _ = capture(lambda: [fn() for _ in range(20)], warmup=fn)
                best = float("inf")
                for _ in range(3):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    graph.replay()
                    b.record()
                    torch.cuda.synchronize()
                    best = min(best, a.elapsed_time(b) * 1e3 / 20)
                row[name + "_us"] = best
                del graph
            rows.append(row)
            print(f"experts H={H} I={I} E={E} k={k} T={t}: " + ", ".join(f"{n} {row[n]:.1f}" for n in row if n.endswith("_us")),
                  flush=True)
    finally:
        F8.EXPERTS_DEQUANT_MIN_ROWS = saved
    return rows


def _timed(eng, prompts, a, key, routes, res, rows, variant) -> None:
    import torch

    from polyrl.types import SamplingParams
    B, N, runs = a.batch, a.new_tokens, []
    for r in range(a.repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=N, seed=r, return_routed_experts=routes))
        dt = time.perf_counter() - t
        assert all(len(s.response_ids) == N for s in out)
        if routes:
            assert all(s.routed_experts.shape[0] == a.prompt_len + N - 1 for s in out)
        st = eng.last_stats
        runs.append({"s": dt, "tok_s": B * N / dt, "decode_tok_s": B * (N - 1) / st["decode_s"], **st})
    best = max(runs, key=lambda x: x["tok_s"])
    res[key] = {"runs": runs, "tok_s": best["tok_s"], "decode_tok_s": best["decode_tok_s"]}
    label = "" if variant == "none" else f", {variant} (linears and experts FP8)"
    rows.append([f"polyrl GPU engine{', routed experts' if routes else ''}{label}", f"{B}x{a.prompt_len}+{N}",
                 fmt(best["tok_s"], "{:.0f}"), fmt(best["decode_tok_s"], "{:.0f}"), fmt(1e3 * best["ttft_first_s"], "{:.1f}")])
    print(rows[-1], flush=True)


def main(argv=None) -> dict:
    a = parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    from polyrl.rollout.gpu import GPUEngine
    from polyrl.types import SamplingParams

    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    from polyrl.dist import set_host_threads
    set_host_threads("cuda", 1)  # as polyrl train and serve set them
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(a),
                 "date": time.strftime("%Y-%m-%d")}
    if a.experts_sweep:
        tokens = [int(t) for t in a.sweep_tokens.split(",")]
        shapes = {a.shape: QWEN3_MOE_SHAPES[a.shape]}
        key = ("hidden_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok")
        shapes.update((n, d) for n, d in EXPERT_DIMS.items()
                      if [d[k] for k in key] != [QWEN3_MOE_SHAPES[a.shape][k] for k in key])
        res["experts_sweep"] = {name: experts_sweep(dims, tokens) for name, dims in shapes.items()}
        write_json(a.out, res)
        if a.sweep_only:
            return res
    mdir = a.model_dir or tempfile.mkdtemp(prefix="moe_bench_")
    t = time.perf_counter()
    if not os.path.exists(os.path.join(mdir, "config.json")):
        res["model"] = build_model_dir(mdir, a.shape, seed=0)
    res["build_s"] = time.perf_counter() - t
    V = QWEN3_MOE_SHAPES[a.shape]["vocab_size"]
    prompts = torch.randint(20, V, (a.batch, a.prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
    B, rows = a.batch, []

    from polyrl.rollout.gpu import triton_ops
    default_mode = triton_ops.FP8_MODE
    for variant in a.quantization.split(","):
        if variant != "none":
            triton_ops.FP8_MODE = variant.split("-", 1)[1]
        eng = GPUEngine(mdir, dtype=torch.bfloat16, max_batch=B, mem_fraction=a.mem_fraction, ignore_eos=True,
                        profile=True, quantization="none" if variant == "none" else "fp8")
        res.setdefault("weights_gib", {})[variant] = eng.model.nbytes / 2**30
        eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16, seed=1))  # compile, capture the buckets
        for key, routes in (("engine", False), ("engine_routes", True)):
            if variant != "none":
                if routes:
                    continue
                key = f"engine_{variant}"
            _timed(eng, prompts, a, key, routes, res, rows, variant)
        del eng
        torch.cuda.empty_cache()
        triton_ops.FP8_MODE = default_mode
    if "engine" in res and len(a.quantization.split(",")) > 1:
        res["fp8_speedup"] = {k[len("engine_"):]: v["tok_s"] / res["engine"]["tok_s"] for k, v in res.items()
                              if k.startswith("engine_fp8")}

    if a.hf_new_tokens:
        hf = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.bfloat16).cuda().eval()
        res["hf_experts_implementation"] = getattr(hf.config, "_experts_implementation", None)
        ids = torch.tensor(prompts, device="cuda")
        hf.generate(ids[:, :16], max_new_tokens=4, do_sample=True, pad_token_id=0)  # warm-up
        torch.cuda.synchronize()
        t = time.perf_counter()
        hf.generate(ids, max_new_tokens=a.hf_new_tokens, min_new_tokens=a.hf_new_tokens, do_sample=True, top_k=0,
                    top_p=1.0, temperature=1.0, pad_token_id=0)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        res["hf"] = {"tok_s": B * a.hf_new_tokens / dt, "s": dt, "new_tokens": a.hf_new_tokens}
        rows.append([f"transformers generate ({res['hf_experts_implementation']} experts)", f"{B}x{a.prompt_len}+{a.hf_new_tokens}",
                     fmt(res["hf"]["tok_s"], "{:.0f}"), "", ""])
        res["speedup_vs_hf"] = res["engine"]["tok_s"] / res["hf"]["tok_s"]

    print(markdown_table(["run", "B x prompt + new", "tokens/s", "decode tokens/s", "TTFT ms"], rows))
    if "speedup_vs_hf" in res:
        print(f"speedup vs transformers generate: {res['speedup_vs_hf']:.1f}x")
    write_json(a.out, res)
    return res


if __name__ == "__main__":
    main()
