"""Rollout throughput of the embedded engine's GPU path vs transformers `generate`.

A Qwen2.5-0.5B-shaped model built from its config with random weights (BF16 on the GPU).
Random weights sample degenerate text, so the throughput runs use ignore-EOS semantics:
no stop ids, every sequence decodes exactly --new-tokens tokens (transformers gets
min_new_tokens = max_new_tokens for the same effect). Temperature 1, no top-k / top-p.

Measured, in one process:
  hf        transformers generate (dynamic cache, sdpa), B prompts x P tokens, N new tokens
  engine    polyrl GPU engine, same setting (after a warm-up call that captures the graphs)
  big       polyrl at --big-batch x --big-new-tokens, against the HBM roofline:
            per decode step, all weights + every live sequence's KV are read once;
            roofline time = sum over steps of those bytes / --hbm-tbps
  greedy    greedy tokens vs transformers greedy (BF16, no padding), divergences classified
            by HF's logit gap at the first mismatch
  logprobs  the engine's sampled-token logprobs vs a plain BF16 HF forward over prompt+response
  update    update_weights of the whole model from GPU BF16 tensors (in place), sleep / wake

  python bench/rollout_throughput.py --out runs/bench/rollout.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import build_model_dir, fmt, hbm_tbps, markdown_table, write_json  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--big-batch", type=int, default=256)
    p.add_argument("--big-new-tokens", type=int, default=512)
    p.add_argument("--hf-new-tokens", type=int, default=256, help="new tokens for the transformers baseline (0: skip it)")
    p.add_argument("--mem-fraction", type=float, default=0.5)
    p.add_argument("--hbm-tbps", type=float, default=None, help="HBM bandwidth for the roofline, TB/s (default: the "
                   "device's, from bench/common.py's HBM_TBPS: H100 SXM 3.35, H200 4.8)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--greedy-prompts", type=int, default=32)
    p.add_argument("--greedy-new-tokens", type=int, default=64)
    p.add_argument("--no-graph-check", action="store_true", help="skip the eager (no CUDA graph) comparison run")
    p.add_argument("--out", default="runs/bench/rollout_throughput.json")
    p.add_argument("--model-dir", default=None, help="reuse a model directory (default: a fresh temporary one)")
    return p.parse_args(argv)


def roofline(engine, B: int, P: int, N: int, tbps: float) -> dict:
    """Bytes a decode step must read (weights once + each sequence's KV so far), summed over
    the N - 1 decode steps (the first token comes from the prefill)."""
    s = engine.spec
    el = 2
    kv_tok = 2 * s.layers * s.kv_heads * s.head_dim * el
    w = engine.model.nbytes  # tied embedding counted once (read as the LM head)
    total = sum(w + B * (P + k) * kv_tok for k in range(1, N))
    t = total / (tbps * 1e12)
    return {"bytes": total, "time_s": t, "tok_s": B * (N - 1) / t, "weights_bytes": w, "kv_bytes_per_token": kv_tok}


def decode_kernel_breakdown(eng, b: int, ctx: int, steps: int = 5) -> list[dict]:
    """GPU time per kernel of `steps` eager decode steps (forward + sampler) at batch b with
    every context `ctx` tokens long (scratch KV contents: the timing is what matters)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    nb = -(-ctx // eng.block_size)
    eng.ctx[:b] = ctx
    eng.bt[:b, :nb] = (1 + torch.arange(b * nb, device=eng.device) % (eng.alloc.num_blocks - 1)).view(b, nb).to(torch.int32)
    eng._max_ctx = ctx

    def step():
        logits = eng._decode_forward(b)
        eng.ops.sample(logits, eng.inv_temp[:b], eng.noise[:b], eng.thresh[:b], eng.seeds[:b], eng.ctx[:b])

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    eng.ctx.fill_(1)
    eng.bt.zero_()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if t > 0:
            rows.append((t, e.key, e.count))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    calls = sum(r[2] for r in rows) / steps
    return [{"kernel": k[:90], "share": t / total, "us_per_step": t / steps, "calls_per_step": c / steps}
            for t, k, c in rows[:14]] + [{"kernel": "TOTAL", "us_per_step": total / steps, "calls_per_step": calls,
                                          "calls_per_layer": calls / eng.spec.layers}]


def main(argv=None) -> dict:
    a = parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    from polyrl.rollout.gpu import GPUEngine
    from polyrl.types import SamplingParams

    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    from polyrl.dist import set_host_threads
    set_host_threads("cuda", 1)  # as polyrl train and serve set them
    dev = torch.cuda.get_device_name()
    if a.hbm_tbps is None:
        a.hbm_tbps = hbm_tbps(dev)
        assert a.hbm_tbps is not None, f"no HBM bandwidth known for {dev!r}: give --hbm-tbps"
    res: dict = {"device": dev, "torch": torch.__version__, "args": vars(a), "date": time.strftime("%Y-%m-%d")}
    mdir = a.model_dir or tempfile.mkdtemp(prefix="rollout_bench_")
    if not os.path.exists(os.path.join(mdir, "config.json")):
        res["model"] = build_model_dir(mdir, a.shape, seed=0)
    g = torch.Generator().manual_seed(0)
    V = 151936 if a.shape.startswith("qwen") else 1000
    prompts = torch.randint(20, V, (a.batch, a.prompt_len), generator=g).tolist()
    big_prompts = torch.randint(20, V, (a.big_batch, a.prompt_len), generator=g).tolist()
    sp = SamplingParams(temperature=1.0, max_new_tokens=a.new_tokens, seed=0)
    rows = []

    # ---- polyrl engine ----
    t = time.perf_counter()
    eng = GPUEngine(mdir, dtype=torch.bfloat16, max_batch=max(a.batch, a.big_batch), mem_fraction=a.mem_fraction,
                    ignore_eos=True, profile=True)
    res["engine_init_s"] = time.perf_counter() - t
    eng.generate(prompts[:8], SamplingParams(temperature=1.0, max_new_tokens=4, seed=1))  # kernel compile
    eng.generate(prompts, sp)  # warm-up at full size: captures the graph buckets used
    runs = []
    for r in range(a.repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=a.new_tokens, seed=r))
        dt = time.perf_counter() - t
        assert all(len(s.response_ids) == a.new_tokens for s in out)
        runs.append({"s": dt, "tok_s": a.batch * a.new_tokens / dt, **{k: v for k, v in eng.last_stats.items()}})
    best = max(runs, key=lambda x: x["tok_s"])
    res["engine"] = {"runs": runs, "tok_s": best["tok_s"]}
    rf = roofline(eng, a.batch, a.prompt_len, a.new_tokens, a.hbm_tbps)
    res["engine"]["roofline"] = rf
    rows.append(["polyrl GPU engine", f"{a.batch}x{a.prompt_len}+{a.new_tokens}", fmt(best["tok_s"], "{:.0f}"),
                 fmt(100 * best["tok_s"] / rf["tok_s"], "{:.1f}%"), fmt(1e3 * best["ttft_first_s"], "{:.1f}"),
                 fmt(100 * best.get("python_overhead_share", float("nan")), "{:.1f}%")])

    if not a.no_graph_check:  # same engine, eager decode (no CUDA graphs): what the graphs buy
        eng.cuda_graph = False
        t = time.perf_counter()
        eng.generate(prompts, sp)
        dt = time.perf_counter() - t
        eng.cuda_graph = True
        res["engine_eager"] = {"tok_s": a.batch * a.new_tokens / dt, **eng.last_stats}
        rows.append(["polyrl, no CUDA graphs", f"{a.batch}x{a.prompt_len}+{a.new_tokens}", fmt(a.batch * a.new_tokens / dt, "{:.0f}"),
                     "", fmt(1e3 * eng.last_stats["ttft_first_s"], "{:.1f}"),
                     fmt(100 * eng.last_stats.get("python_overhead_share", float("nan")), "{:.1f}%")])

    # ---- big batch vs roofline ----
    bsp = SamplingParams(temperature=1.0, max_new_tokens=a.big_new_tokens, seed=0)
    eng.generate(big_prompts, SamplingParams(temperature=1.0, max_new_tokens=8, seed=1))  # capture its bucket
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = eng.generate(big_prompts, bsp)
    dt = time.perf_counter() - t
    st = eng.last_stats
    rfb = roofline(eng, a.big_batch, a.prompt_len, a.big_new_tokens, a.hbm_tbps)
    tok_s = a.big_batch * a.big_new_tokens / dt
    decode_tok_s = a.big_batch * (a.big_new_tokens - 1) / st["decode_s"]
    res["big"] = {"tok_s": tok_s, "s": dt, "roofline": rfb, "roofline_pct": 100 * tok_s / rfb["tok_s"],
                  "decode_only_roofline_pct": 100 * rfb["time_s"] / st["decode_s"], "decode_tok_s": decode_tok_s, **st}
    rows.append(["polyrl GPU engine", f"{a.big_batch}x{a.prompt_len}+{a.big_new_tokens}", fmt(tok_s, "{:.0f}"),
                 fmt(100 * tok_s / rfb["tok_s"], "{:.1f}%") + f" (decode only {100 * rfb['time_s'] / st['decode_s']:.1f}%)",
                 fmt(1e3 * st["ttft_first_s"], "{:.1f}"), fmt(100 * st.get("python_overhead_share", float("nan")), "{:.1f}%")])
    del out

    try:  # where a decode step's GPU time goes (eager launches; the kernels are those the graph replays)
        res["kernel_breakdown_b256_ctx384"] = decode_kernel_breakdown(eng, min(256, eng.max_running), a.prompt_len + a.big_new_tokens // 2)
    except Exception as e:  # noqa: BLE001 (a profiler problem must not lose the other numbers)
        res["kernel_breakdown_b256_ctx384"] = repr(e)

    # ---- update_weights, sleep / wake ----
    hf = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.bfloat16).cuda().eval()
    named = [(n, p.detach()) for n, p in hf.named_parameters()]
    eng.update_weights(named, version=1)
    torch.cuda.synchronize()
    t = time.perf_counter()
    eng.update_weights(named, version=2)
    res["update_weights_s"] = time.perf_counter() - t
    res["update_weights_bytes"] = sum(p.numel() * p.element_size() for _, p in named)
    cpu_named = [(n, p.float().cpu()) for n, p in named]
    t = time.perf_counter()
    eng.update_weights(cpu_named, version=3)
    res["update_weights_from_cpu_fp32_s"] = time.perf_counter() - t
    del cpu_named
    torch.cuda.synchronize()
    a0, f0 = torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]
    t = time.perf_counter()
    eng.sleep()
    res["sleep_s"] = time.perf_counter() - t
    a1, f1 = torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]
    t = time.perf_counter()
    eng.wake()
    torch.cuda.synchronize()
    res["wake_s"] = time.perf_counter() - t
    res["sleep_released_bytes"] = {"allocated": a0 - a1, "free_gain": f1 - f0, "weights+kv": eng.model.nbytes + eng.kv.nbytes}

    # ---- correctness: greedy vs transformers, logprobs vs an HF forward ----
    gp = torch.randint(20, V, (a.greedy_prompts, 32), generator=g).tolist()
    ours = eng.generate(gp, SamplingParams(temperature=0.0, max_new_tokens=a.greedy_new_tokens))
    ref = hf.generate(torch.tensor(gp, device="cuda"), max_new_tokens=a.greedy_new_tokens, min_new_tokens=a.greedy_new_tokens,
                      do_sample=False, pad_token_id=0)[:, 32:].tolist()
    equal, div = 0, []
    for p, s, r in zip(gp, ours, ref):
        if s.response_ids == r:
            equal += 1
            continue
        k = next(i for i, (x, y) in enumerate(zip(s.response_ids, r)) if x != y)
        with torch.no_grad():
            lg = hf(torch.tensor([p + r[:k]], device="cuda")).logits[0, -1].float()
        div.append({"pos": k, "gap": (lg[r[k]] - lg[s.response_ids[k]]).item(), "logit": lg[r[k]].item()})
    near = sum(abs(d["gap"]) <= max(0.125, 0.02 * abs(d["logit"])) for d in div)
    res["greedy"] = {"prompts": len(gp), "new_tokens": a.greedy_new_tokens, "identical": equal, "diverged_after_near_tie": near,
                     "diverged_otherwise": len(div) - near, "divergences": div}
    samples = eng.generate(prompts[:32], SamplingParams(temperature=1.0, max_new_tokens=128, seed=3))
    diffs = []
    for s in samples:
        with torch.no_grad():
            lg = hf(torch.tensor([s.prompt_ids + s.response_ids], device="cuda")).logits[0, len(s.prompt_ids) - 1:-1].float()
        want = torch.log_softmax(lg, -1).gather(-1, torch.tensor(s.response_ids, device="cuda")[:, None]).squeeze(-1)
        diffs.append((torch.tensor(s.rollout_logprobs, device="cuda") - want).abs())
    d = torch.cat(diffs)
    res["logprob_vs_hf_bf16"] = {"tokens": d.numel(), "mean_abs": d.mean().item(), "max_abs": d.max().item(),
                                 "p99_abs": d.quantile(0.99).item()}
    del eng
    torch.cuda.empty_cache()

    # ---- transformers baseline ----
    if a.hf_new_tokens:
        ids = torch.tensor(prompts, device="cuda")
        hf.generate(ids[:, :16], max_new_tokens=4, do_sample=True, pad_token_id=0)  # warm-up
        torch.cuda.synchronize()
        t = time.perf_counter()
        hf.generate(ids, max_new_tokens=a.hf_new_tokens, min_new_tokens=a.hf_new_tokens, do_sample=True, top_k=0, top_p=1.0,
                    temperature=1.0, pad_token_id=0)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        res["hf_dynamic"] = {"tok_s": a.batch * a.hf_new_tokens / dt, "s": dt, "new_tokens": a.hf_new_tokens}
        rows.append(["transformers generate (dynamic cache)", f"{a.batch}x{a.prompt_len}+{a.hf_new_tokens}",
                     fmt(res["hf_dynamic"]["tok_s"], "{:.0f}"), "", "", ""])
        res["speedup_vs_hf_dynamic"] = res["engine"]["tok_s"] / res["hf_dynamic"]["tok_s"]

    print(markdown_table(["run", "B x prompt + new", "tokens/s", "of HBM roofline", "TTFT ms", "python overhead"], rows))
    if "speedup_vs_hf_dynamic" in res:
        print(f"speedup vs transformers dynamic-cache generate: {res['speedup_vs_hf_dynamic']:.1f}x")
    print(f"B={a.big_batch}: {res['big']['roofline_pct']:.1f}% of the {a.hbm_tbps} TB/s roofline end to end "
          f"({res['big']['decode_only_roofline_pct']:.1f}% over decode steps only); roofline {rfb['tok_s']:.0f} tok/s")
    gr, lp = res["greedy"], res["logprob_vs_hf_bf16"]
    print(f"greedy vs transformers: {gr['identical']}/{gr['prompts']} identical over {gr['new_tokens']} tokens, "
          f"{gr['diverged_after_near_tie']} diverged after a near-tie, {gr['diverged_otherwise']} otherwise")
    print(f"logprobs vs BF16 HF forward: mean abs diff {lp['mean_abs']:.4f} (max {lp['max_abs']:.3f}) over {lp['tokens']} tokens")
    print(f"update_weights (in place, {res['update_weights_bytes'] / 2**30:.2f} GiB from GPU BF16): {1e3 * res['update_weights_s']:.1f} ms; "
          f"from CPU fp32: {1e3 * res['update_weights_from_cpu_fp32_s']:.0f} ms; sleep {1e3 * res['sleep_s']:.0f} ms released "
          f"{res['sleep_released_bytes']['allocated'] / 2**30:.2f} GiB (free +{res['sleep_released_bytes']['free_gain'] / 2**30:.2f} GiB), "
          f"wake {1e3 * res['wake_s']:.0f} ms")
    kb = res["kernel_breakdown_b256_ctx384"]
    if isinstance(kb, list):
        print("decode step GPU time by kernel (eager, B=256, context 384):")
        for r in kb:
            print(f"  {r['us_per_step']:8.1f} us  {100 * r.get('share', 1):5.1f}%  x{r.get('calls_per_step', 0):4.0f}  {r['kernel']}")
        print(f"  kernels per decode step {kb[-1]['calls_per_step']:.0f}, per layer {kb[-1]['calls_per_layer']:.1f} "
              "(the LM head and sampler included)")
    write_json(a.out, res)
    return res


if __name__ == "__main__":
    main()
