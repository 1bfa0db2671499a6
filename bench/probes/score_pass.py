"""The --true-on-policy engine's scoring pass alone (polyrl.backends.true_on_policy.score_samples through CUDA graphs,
GraphedScoring), on a model shape with random weights: a GRPO step's samples (prompts x samples of `--prompt`
+ `--response` random tokens), wall time per pass and its GPU time by kernel class from one profiled pass, at each
graphed pack granularity (`--graph-rows`) and pack size (`--pack-tokens`) given. The pass's floor is its matmuls:
the last column is the pass's model FLOPs (2 x matmul parameters per body token of every sample, a shared prompt counted
once per sample; the LM head's on response tokens)
over its wall time, as a share of `--peak-tflops`.

    python3 bench/probes/score_pass.py --shape qwen2.5-0.5b --graph-rows 4096 2048 --pack-tokens 16384 40960
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import statistics
import sys
import time
import types

# the mode's own kernels, split out of polyrl.metrics' elementwise/reduce class
OWN = (("rms_rows", "rms"), ("row_stats", "head"))


def kernel_class(name: str) -> str:
    """polyrl.metrics.kernel_class, with the row RMSNorm and the log-prob head's row statistics named apart."""
    from polyrl.metrics import kernel_class as by_class
    low = name.lower()
    if low.startswith(("memcpy", "memset")):
        return "copy"
    return next((c for key, c in OWN if key in low), None) or by_class(name)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt", type=int, default=40, help="prompt tokens per sample")
    p.add_argument("--response", type=int, default=256, help="response tokens per sample")
    p.add_argument("--graph-rows", type=int, nargs="+", default=None, help="GRAPH_ROWS values (default: the mode's)")
    p.add_argument("--pack-tokens", type=int, nargs="+", default=None, help="PACK_TOKENS values (default: the mode's)")
    p.add_argument("--share", type=int, nargs="+", default=[1], help="SHARE_PROMPTS values: 1, a group's prompt rows "
                   "computed once; 0, once per sample")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense BF16 peak (H100 / H200 SXM: 989)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM, Qwen2Config

    import polyrl.backends.true_on_policy as top
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/common.py
    from common import QWEN_SHAPES
    if not torch.cuda.is_available():
        print("score_pass: needs a CUDA GPU (the graphed scoring pass)", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = Qwen2Config(**QWEN_SHAPES[a.shape], max_position_embeddings=4096)
    lm = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation=top.register_attention())
    lm = lm.to(dev).eval().requires_grad_(False)
    top.prepare(lm)
    top.compile_layers(lm, dev)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (a.prompt,), generator=g).tolist() for _ in range(a.prompts)]
    samples = [types.SimpleNamespace(prompt_ids=p, response_ids=torch.randint(0, cfg.vocab_size, (a.response,),
                                                                              generator=g).tolist())
               for p in prompts for _ in range(a.samples)]  # a GRPO step: each prompt's samples one after another
    head = cfg.vocab_size * cfg.hidden_size
    body = sum(p.numel() for n, p in lm.named_parameters() if p.dim() == 2 and "embed" not in n and "lm_head" not in n)
    flops = 2 * body * len(samples) * (a.prompt + a.response) + 2 * head * len(samples) * a.response
    print(f"{a.shape}, {len(samples)} samples of {a.prompt} + {a.response} tokens, {torch.cuda.get_device_name()}",
          flush=True)
    cols = ("gemm", "attention", "elementwise/reduce", "head", "rms")
    print("| shared prompts | GRAPH_ROWS | PACK_TOKENS | wall ms (median) | GPU ms | " + " | ".join(cols) + " | other | "
          "model FLOP/s of peak |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    for rows, pack, share in itertools.product(a.graph_rows or [top.GRAPH_ROWS], a.pack_tokens or [top.PACK_TOKENS],
                                               a.share):
        top.GRAPH_ROWS, top.PACK_TOKENS, top.SHARE_PROMPTS = rows, pack, bool(share)
        graphs = top.GraphedScoring(lm, dev)
        with torch.no_grad():
            for _ in range(3):  # captures, then warm replays
                top.score_samples(lm, samples, 1.0, dev, graphs)
            times = []
            for _ in range(a.repeats):
                torch.cuda.synchronize()
                t = time.perf_counter()
                top.score_samples(lm, samples, 1.0, dev, graphs)
                torch.cuda.synchronize()  # the log-probs stay on the device
                times.append(time.perf_counter() - t)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                top.score_samples(lm, samples, 1.0, dev, graphs)
                torch.cuda.synchronize()
        by: collections.Counter = collections.Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                by[kernel_class(e.name)] += e.device_time_total / 1e3
        wall = statistics.median(times)
        cells = " | ".join(f"{by[c]:.1f}" for c in cols)
        other = sum(by.values()) - sum(by[c] for c in cols)
        print(f"| {'yes' if share else 'no'} | {rows} | {pack} | {wall * 1e3:.1f} | {sum(by.values()):.1f} | {cells} | "
              f"{other:.1f} | {flops / wall / (a.peak_tflops * 1e12):.1%} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
