"""Decode throughput of the embedded engine's GPU path on a Qwen3-MoE shape vs transformers `generate`.

A Qwen3-MoE-shaped model (bench/common.py QWEN3_MOE_SHAPES, random BF16 weights) on one GPU, ignore-EOS semantics
(every sequence decodes exactly --new-tokens; transformers gets min_new_tokens = max_new_tokens), temperature 1.

  engine          polyrl GPU engine (CUDA graphs, torch grouped GEMM experts), after a warm-up call
  engine+routes   the same with return_routed_experts (R3's per-token routes copied to the host every step)
  hf              transformers generate (dynamic cache, its default experts implementation)

  PYTHONPATH=. python3 bench/moe_rollout.py --out runs/bench/moe_rollout.json
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
    return p.parse_args(argv)


def main(argv=None) -> dict:
    a = parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    from polyrl.rollout.gpu import GPUEngine
    from polyrl.types import SamplingParams

    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(a),
                 "date": time.strftime("%Y-%m-%d")}
    mdir = a.model_dir or tempfile.mkdtemp(prefix="moe_bench_")
    t = time.perf_counter()
    if not os.path.exists(os.path.join(mdir, "config.json")):
        res["model"] = build_model_dir(mdir, a.shape, seed=0)
    res["build_s"] = time.perf_counter() - t
    V = QWEN3_MOE_SHAPES[a.shape]["vocab_size"]
    prompts = torch.randint(20, V, (a.batch, a.prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
    B, N, rows = a.batch, a.new_tokens, []

    eng = GPUEngine(mdir, dtype=torch.bfloat16, max_batch=B, mem_fraction=a.mem_fraction, ignore_eos=True, profile=True)
    eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16, seed=1))  # compile, capture the buckets
    for key, routes in (("engine", False), ("engine_routes", True)):
        runs = []
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
        rows.append([f"polyrl GPU engine{', routed experts' if routes else ''}", f"{B}x{a.prompt_len}+{N}",
                     fmt(best["tok_s"], "{:.0f}"), fmt(best["decode_tok_s"], "{:.0f}"), fmt(1e3 * best["ttft_first_s"], "{:.1f}")])
    del eng, out
    torch.cuda.empty_cache()

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
