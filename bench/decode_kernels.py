"""The GPU engine's decode-step kernels, one at a time, at the Qwen2.5-0.5B shape: where a decode
step's time goes and which launch settings are fastest on this GPU.

Each kernel is captured in a CUDA graph of --iters back-to-back launches and replayed, so the
time is GPU time without launch gaps (as in the engine's captured decode step). Rows:
  sampler     polyrl.rollout.gpu.triton_ops.sample over [B, V] BF16 logits (--baseline-ops: another
              version beside it); GB/s = logits bytes / time
  attention   paged decode attention, B sequences of --ctx tokens (random pages; three caches
              used in turn, so the KV comes from HBM), per (block_n, num_warps, num_stages,
              splits); GB/s = KV bytes read / time
  gemm        the decode layer's GEMMs at M = B rows (qkv, o, gate_up, down, lm_head), cuBLAS
              and cuBLASLt, weights read from HBM (cycled through copies larger than L2, as in a
              decode step); GB/s = weight bytes / time, TFLOP/s = 2 M N K / time
  elementwise add_rmsnorm, rope_store, silu_mul at T = B

  python bench/decode_kernels.py --batch 256 --ctx 384 --out runs/bench/decode_kernels.json
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fmt, markdown_table, write_json  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[256])
    p.add_argument("--ctx", type=int, default=384, help="tokens in each sequence's cache (attention rows)")
    p.add_argument("--block-size", type=int, nargs="+", default=[16],
                   help="attention: KV cache block sizes (tokens per page) to time; the engine's default is 16")
    p.add_argument("--iters", type=int, default=20, help="launches per captured graph")
    p.add_argument("--repeats", type=int, default=5, help="graph replays; the best is reported")
    p.add_argument("--sweep", action="store_true", help="attention and the top-k / top-p thresholds: every launch setting, not only the default")
    p.add_argument("--baseline-ops", default=None, help="a file with another triton_ops (e.g. an older commit's) to time beside")
    p.add_argument("--only", nargs="+", default=None, choices=["sampler", "attention", "gemm", "elementwise"],
                   help="run these kernel groups only")
    p.add_argument("--out", default="runs/bench/decode_kernels.json")
    return p.parse_args(argv)


def gpu_time(fn, iters: int, repeats: int) -> float:
    """Seconds per call of fn: iters calls captured in one CUDA graph, best of `repeats` replays."""
    import torch
    from polyrl.rollout.gpu.graphs import capture
    fn()
    torch.cuda.synchronize()
    g, _ = capture(lambda: [fn() for _ in range(iters)], warmup=fn)
    best = float("inf")
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3 / iters)
    return best


def load_ops(path: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location("baseline_triton_ops", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> dict:
    a = parse_args(argv)
    import torch
    import torch.nn.functional as F

    from polyrl.rollout.gpu import ops as rops, triton_ops as tops
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    dev, bf = "cuda", torch.bfloat16
    torch.manual_seed(0)
    H, I, V, L, hq, hkv, d = 896, 4864, 151936, 24, 14, 2, 64  # Qwen2.5-0.5B
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(a),
                 "date": time.strftime("%Y-%m-%d"), "rows": []}
    rows = []

    def add(kind, what, B, t, nbytes=None, flops=None):
        r = {"kind": kind, "what": what, "B": B, "us": t * 1e6, "GB_s": nbytes / t / 1e9 if nbytes else None,
             "TFLOP_s": flops / t / 1e12 if flops else None}
        res["rows"].append(r)
        rows.append([kind, what, B, fmt(r["us"], "{:.1f}"), fmt(r["GB_s"], "{:.0f}") if nbytes else "",
                     fmt(r["TFLOP_s"], "{:.0f}") if flops else ""])
        print(rows[-1], flush=True)

    base = load_ops(a.baseline_ops) if a.baseline_ops else None
    for B in a.batch:
        if a.only is None or "sampler" in a.only:
            # ---- sampler ----
            logits = (torch.randn(B, V, device=dev) * 4).to(bf)
            it = torch.ones(B, device=dev)
            noise = torch.ones(B, device=dev, dtype=torch.int32)
            thr = torch.full((B,), float("-inf"), device=dev)
            seeds, ctr = torch.arange(B, device=dev), torch.zeros(B, device=dev, dtype=torch.long)
            t = gpu_time(lambda: tops.sample(logits, it, noise, thr, seeds, ctr), a.iters, a.repeats)
            add("sampler", "chunk stats + two-level inverse CDF", B, t, logits.numel() * 2)
            thr_k = torch.zeros(B, device=dev)  # a top-k / top-p threshold that keeps half the vocabulary
            t = gpu_time(lambda: tops.sample(logits, it, noise, thr_k, seeds, ctr), a.iters, a.repeats)
            add("sampler", "the same, filtered rows", B, t, logits.numel() * 2)
            if base is not None:
                t = gpu_time(lambda: base.sample(logits, it, noise, thr, seeds, ctr), a.iters, a.repeats)
                add("sampler", "baseline default", B, t, logits.numel() * 2)
            for k, p in ((50, 0.9), (0, 0.9)):  # the top-k / top-p thresholds: Triton searches vs the torch sort
                kt = torch.tensor([k], dtype=torch.int32, device=dev)  # as the engine passes them (device memory)
                pt = torch.tensor([p], dtype=torch.float32, device=dev)
                default = (tops.FILTER_BLOCK, tops.FILTER_WARPS, tops.FILTER_SEGMENT)
                more = [(256, 4, 4096), (512, 4, 8192), (512, 8, 16384), (1024, 8, 8192), (512, 4, 4096)]
                for blk, nw, seg in [default] + (more if a.sweep else []):
                    tops.FILTER_BLOCK, tops.FILTER_WARPS, tops.FILTER_SEGMENT = blk, nw, seg
                    t = gpu_time(lambda: tops.filter_thresholds(logits, it, kt, pt), a.iters, a.repeats)
                    add("sampler", f"thresholds top_k={k} top_p={p} triton block={blk} warps={nw} segment={seg}", B, t,
                        logits.numel() * 2)
                tops.FILTER_BLOCK, tops.FILTER_WARPS, tops.FILTER_SEGMENT = default
                t = gpu_time(lambda: rops.filter_thresholds(logits, it, k, p), a.iters, a.repeats)
                add("sampler", f"thresholds top_k={k} top_p={p} torch sort", B, t, logits.numel() * 2)
            del logits
        if a.only is None or "attention" in a.only:
            # ---- paged decode attention ----
            for BS in a.block_size:
                nb = -(-a.ctx // BS)
                NB = B * nb + 1
                # three layers' caches used in turn, so the KV is read from HBM as in a decode step, not from L2
                caches = [tuple(torch.randn(NB * BS, hkv, d, device=dev, dtype=bf) for _ in range(2)) for _ in range(3)]
                q = torch.randn(B, hq, d, device=dev, dtype=bf)
                bt = (1 + torch.randperm(NB - 1, device=dev)[:B * nb]).view(B, nb).to(torch.int32)
                ctx = torch.full((B,), a.ctx, device=dev, dtype=torch.int32)
                kv_bytes = 2 * B * a.ctx * hkv * d * 2
                grid = [(None, None, None, 1)]
                if a.sweep:
                    grid += list(itertools.product((32, 64, 128), (2, 4, 8), (2, 3), (1, 2, 4)))
                for bn, nw, ns, sp in grid:
                    split = torch.tensor([-(-a.ctx // (sp * 64)) * 64], device=dev, dtype=torch.int32)
                    cyc = itertools.cycle(caches)

                    def attn():
                        kc, vc = next(cyc)
                        return tops.paged_decode_attention(q, kc, vc, bt, ctx, BS, sp, split, bn, nw, ns)
                    try:
                        t = gpu_time(attn, max(a.iters, 3), a.repeats)
                    except Exception as e:  # noqa: BLE001 (a setting that does not compile, e.g. out of shared memory)
                        print(f"attention {bn}/{nw}/{ns}/{sp}: {type(e).__name__}", flush=True)
                        continue
                    add("attention", f"block_size={BS} block_n={bn} warps={nw} stages={ns} splits={sp}", B, t, kv_bytes)
            del caches
        if a.only is None or "gemm" in a.only:
            # ---- GEMMs of one layer + the LM head ----
            # weights cycled through copies that together exceed the L2 cache, so each launch reads its weight from HBM
            # as in a decode step (the same weight launched back to back would be served from L2)
            x = torch.randn(B, max(H, I), device=dev, dtype=bf)
            shapes = {"qkv": (hq * d + 2 * hkv * d, H), "o": (H, hq * d), "gate_up": (2 * I, H), "down": (H, I), "lm_head": (V, H)}
            bias = {"qkv": torch.randn(hq * d + 2 * hkv * d, device=dev, dtype=bf)}
            l2 = torch.cuda.get_device_properties(dev).L2_cache_size
            for name, (n, k) in shapes.items():
                copies = max(1, -(-4 * l2 // (n * k * 2)))
                ws = [torch.randn(n, k, device=dev, dtype=bf) for _ in range(copies)]
                xi, bi = x[:, :k].contiguous(), bias.get(name)
                cyc = itertools.cycle(ws)

                def run(f):
                    return gpu_time(lambda: f(xi, next(cyc), bi), max(a.iters, copies), a.repeats)

                for lib in ("cublas", "cublaslt"):
                    torch.backends.cuda.preferred_blas_library(lib)
                    add("gemm", f"{name} {n}x{k} {lib}", B, run(F.linear), n * k * 2, 2 * B * n * k)
                torch.backends.cuda.preferred_blas_library("cublas")
                del ws
        if a.only is None or "elementwise" in a.only:
            # ---- elementwise ----
            h, r, wn = torch.randn(B, H, device=dev, dtype=bf), torch.randn(B, H, device=dev, dtype=bf), torch.randn(H, device=dev, dtype=bf)
            add("elementwise", "add_rmsnorm", B, gpu_time(lambda: tops.add_rmsnorm(h, r, wn, 1e-6), a.iters, a.repeats), 4 * B * H * 2)
            qkv = torch.randn(B, (hq + 2 * hkv) * d, device=dev, dtype=bf)
            pos = torch.arange(B, device=dev)
            slots = torch.arange(B, device=dev)
            kc1, vc1 = torch.zeros(B, hkv, d, device=dev, dtype=bf), torch.zeros(B, hkv, d, device=dev, dtype=bf)
            cos, sin = torch.randn(4096, d // 2, device=dev, dtype=bf), torch.randn(4096, d // 2, device=dev, dtype=bf)
            add("elementwise", "rope_store", B, gpu_time(lambda: tops.rope_store(qkv, pos, slots, kc1, vc1, cos, sin, hq, hkv, d,
                                                                                  write_k=False), a.iters, a.repeats),
                2 * qkv.numel() * 2)
            gu = torch.randn(B, 2 * I, device=dev, dtype=bf)
            add("elementwise", "silu_mul", B, gpu_time(lambda: tops.silu_mul(gu), a.iters, a.repeats), 3 * B * I * 2)
            del x, gu
    print(markdown_table(["kernel", "setting", "B", "us", "GB/s", "TFLOP/s"], rows))
    write_json(a.out, res)
    return res


if __name__ == "__main__":
    main()
