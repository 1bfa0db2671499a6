"""Training-step throughput and MFU of a train backend on packed micro-batches.

One step = forward + backward + optimizer over one packed micro-batch per rank (the RL loss,
log-probs and entropy from hidden states in chunks). Random-weight models of Qwen2.5 shapes,
BF16 compute with FP32 master weights.

FLOPs per step = 6 * N * tokens + attention, where N counts the parameters that take part in
matmuls (all but the input embedding; the tied LM head counts once as a matmul) and the causal
attention term is 6 * layers * heads * head_dim * sum_i(s_i^2) (fwd QK^T + PV = 2*2*s^2*d/2, x3
for fwd+bwd). MFU = achieved FLOP/s / dense BF16 peak (989 TFLOP/s for H100 SXM and H200).

    python bench/train_throughput.py --model-shape qwen2.5-0.5b qwen2.5-1.5b --tokens 16384
    torchrun --nproc-per-node 2 bench/train_throughput.py --model-shape qwen2.5-1.5b
"""

from __future__ import annotations

import argparse
import gc
import functools
import json
import os
import random
import statistics
import tempfile
import time

SHAPES = {
    # Qwen2.5 configs (hidden, intermediate, layers, heads, kv heads, vocab), tied embeddings
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, vocab_size=151936),
}
PEAK_BF16 = {"H100": 989e12, "H200": 989e12}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-shape", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b"], choices=sorted(SHAPES))
    p.add_argument("--train-backend", default="fsdp", choices=["fsdp", "megatron"])
    p.add_argument("--tokens", type=int, nargs="+", default=[16384], help="tokens per packed micro-batch per rank")
    p.add_argument("--min-len", type=int, default=512)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--variants", default="base", help="comma list of: base, compile, ac, compile+ac, sdpa "
                   "(megatron: base, compile = its --compile (polyrl's norms and RoPE), ac = full recompute, keepgrads = "
                   "--no-release-grad-buffers, nofusion = --no-gradient-accumulation-fusion, gcfreeze = no automatic garbage collection in the measured steps (either backend); fsdp: exact = the "
                   "--true-on-policy trainer, compiled on CUDA as the mode decides, exact+capN with N blocks of its fixed-row GEMMs per batched launch (default 8); combine with +, e.g. compile+ac); base "
                   "is eager on both backends")
    p.add_argument("--rows", nargs="+", default=None, metavar="BACKEND:VARIANT:TOKENS",
                   help="run these rows in this order on one model (e.g. megatron:base:8192 fsdp:compile:8192), so "
                        "backends are compared in one process; replaces --train-backend / --variants / --tokens")
    p.add_argument("--chunk", type=int, default=4096, help="tokens per log-prob chunk")
    p.add_argument("--peak-tflops", type=float, default=None, help="override the dense BF16 peak")
    p.add_argument("--out", default=None, help="append JSON rows here")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--isolate", action="store_true", help="run each row in a fresh process (one model written "
                   "once): no row inherits an earlier row's leftovers (megatron-core's reference cycles, compiled "
                   "code, allocator state), as a user's run, which builds one backend, does not")
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)  # --isolate's rows: the model already written
    p.add_argument("--busy", action="store_true",
                   help="CUDA: record each measured step's device time by kernel class (a CUDA-only profiler around "
                        "the step, no host-side tracing): a step that slows while its device time stays waited on "
                        "the host; one whose kernels slow did not (CUPTI adds a little host time per launch: compare "
                        "rows that all use --busy)")
    p.add_argument("--profile", nargs="*", default=None, metavar="BACKEND:VARIANT:TOKENS",
                   help="print the top CUDA kernels of one measured step of every row, or of the rows named")
    p.add_argument("--host-profile", action="store_true",
                   help="cProfile the host's Python over the first measured step of every row and print the functions "
                        "that took the most of it (own time): where a step that waits on the host spends it")
    a = p.parse_args(argv)
    if a.busy and a.device != "cuda":
        p.error("--busy reads CUDA kernel times; it has nothing to record with --device cpu")
    for variant in ([r.split(":")[1] for r in a.rows if r.count(":") == 2] if a.rows else a.variants.split(",")):
        try:
            block_cap(variant)
        except ValueError as e:
            p.error(str(e))
    return a


def make_model(shape: str, path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from polyrl.tasks.arithmetic import build_tokenizer
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=1e6)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # random init is slow on CPU for 1.5B
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    m.save_pretrained(path)
    build_tokenizer(path)


def matmul_params(model_dir: str) -> tuple[int, dict]:
    from transformers import AutoConfig
    c = AutoConfig.from_pretrained(model_dir)
    h, i, L, nh, kv = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads
    hd = h // nh
    attn = h * nh * hd + 2 * h * kv * hd + nh * hd * h
    mlp = 3 * h * i
    return L * (attn + mlp) + c.vocab_size * h, dict(layers=L, heads=nh, head_dim=hd)


def total_params(model_dir: str) -> int:
    """Every parameter of the HF model (the tied LM head once): the denominator of state bytes per parameter."""
    from transformers import AutoConfig
    c = AutoConfig.from_pretrained(model_dir)
    h, i, L, nh, kv = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads
    hd = h // nh
    attn = h * nh * hd + 2 * h * kv * hd + nh * hd * h + nh * hd + 2 * kv * hd  # Qwen2: q/k/v biases
    layer = attn + 3 * h * i + 2 * h  # two RMSNorms
    return L * layer + c.vocab_size * h * (1 if c.tie_word_embeddings else 2) + h


def synthetic_batch(tokens: int, lo: int, hi: int, vocab: int, seed: int):
    import torch

    from polyrl.types import TrainBatch
    rng = random.Random(seed)
    lens = []
    while sum(lens) < tokens:
        lens.append(min(rng.randint(lo, hi), tokens - sum(lens)))
    if lens[-1] < 8:
        lens[-2] += lens.pop()
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab, (l,), generator=g) for l in lens]
    plens = [max(1, l // 4) for l in lens]
    fields = {"loss_mask": [torch.ones(l - p) for l, p in zip(lens, plens)],
              "advantages": [torch.full((l - p,), rng.choice([-1.0, 1.0])) for l, p in zip(lens, plens)],
              "rollout_logprobs": [torch.full((l - p,), -1.0) for l, p in zip(lens, plens)]}
    return TrainBatch(ids, plens, fields), lens


def print_host_profile(prof, row: str, wall: float, top: int = 30) -> None:
    """The functions that took the most host time (own time, then with callees) in a cProfile'd step."""
    import io
    import pstats
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    print(f"host profile of {row}: {wall:.3f} s step (profiled), {st.total_tt:.3f} s of Python in it", flush=True)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    print(buf.getvalue(), flush=True)


def block_cap(variant: str) -> int | None:
    """The `capN` part of an exact variant (e.g. exact+cap32): --true-on-policy's fixed-row blocks per batched GEMM
    launch for that row (BlockBatches.cap; each count is still checked bit for bit before use)."""
    caps = [int(p[3:]) for p in variant.split("+") if p.startswith("cap") and p[3:].isdigit()]
    if caps and "exact" not in variant.split("+"):
        raise ValueError(f"variant {variant!r}: capN is the exact trainer's blocks per launch; add +exact")
    if len(caps) > 1 or (caps and caps[0] < 1):
        raise ValueError(f"variant {variant!r}: one capN part, N >= 1")
    return caps[0] if caps else None


def run_one(a, shape: str, model_dir: str, tokens: int, variant: str, backend: str) -> dict:
    import torch
    import torch.distributed as dist

    from polyrl.algorithms.losses import LossSettings, rl_loss
    from polyrl.backends.base import load_backend_class
    from polyrl.config import BatchConfig, ModelConfig, OptimizerConfig
    from polyrl.metrics import GcWatch
    parts = set(variant.split("+"))
    exact = "exact" in parts  # --true-on-policy's trainer: it decides compilation itself (compile_layers)
    cap = block_cap(variant)
    if exact:  # every exact row sets the cap, so that a capN row does not leak into the rows after it
        from polyrl.backends import true_on_policy
        true_on_policy.BATCHED.cap = cap or true_on_policy.BlockBatches().cap
    mc = ModelConfig(hf_checkpoint=model_dir, compile=None if exact else "compile" in parts,
                     gradient_checkpointing="ac" in parts, true_on_policy=exact,
                     attn_implementation="sdpa" if variant == "sdpa" else "auto", logprob_chunk_size=a.chunk)
    bc = BatchConfig(use_dynamic_batch_size=True, max_tokens_per_gpu=tokens)
    extra = {}
    if backend == "megatron":  # TP=1; `ac` = megatron's full recompute of every layer
        from polyrl.config import MegatronConfig
        ac = "ac" in parts
        extra["megatron_cfg"] = MegatronConfig(recompute_granularity="full" if ac else None,
                                               recompute_method="uniform" if ac else None,
                                               recompute_num_layers=1 if ac else None,
                                               release_grad_buffers="keepgrads" not in parts,
                                               gradient_accumulation_fusion="nofusion" not in parts)
    be = load_backend_class(backend)(mc, OptimizerConfig(lr=1e-6), bc, device=a.device,
                                             total_steps=a.steps + a.warmup, **extra)
    n_params, geo = matmul_params(model_dir)
    rank, world = dist.get_rank(), dist.get_world_size()
    loss_fn = functools.partial(rl_loss, s=LossSettings())
    times, flops = [], []
    cuda = a.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.reset_accumulated_memory_stats()
    watch = GcWatch()  # seconds the cyclic garbage collector held the host in each step
    gc_times, busy = [], []
    probe_before = host_probe_ms()
    for step in range(a.warmup + a.steps):
        if step == a.warmup and "gcfreeze" in parts:  # what Megatron-LM's --manual-gc does: no collection mid-step
            watch.freeze()
            gc.disable()
        watch.take()
        batch, lens = synthetic_batch(tokens, a.min_len, a.max_len, SHAPES[shape]["vocab_size"], seed=step * world + rank)
        prof = None
        profiled = a.profile is not None and (not a.profile or f"{backend}:{variant}:{tokens}" in a.profile)
        if profiled and step == a.warmup and rank == 0:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                                          with_stack=True)
            prof.__enter__()
        device_only = None
        if a.busy and prof is None and step >= a.warmup:
            device_only = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            device_only.__enter__()
        host = None
        if a.host_profile and step == a.warmup and rank == 0:
            import cProfile
            host = cProfile.Profile()
        sync()
        t0 = time.perf_counter()
        if host is not None:
            host.enable()
        be.train_step(batch, loss_fn, with_entropy=True)
        if host is not None:
            host.disable()
        sync()
        dt = time.perf_counter() - t0
        if host is not None:
            print_host_profile(host, f"{backend}:{variant}:{tokens}", dt)
        if prof is not None:
            prof.__exit__(None, None, None)
            print_profile(prof, dt)
        if device_only is not None:
            device_only.__exit__(None, None, None)
            busy.append(device_time(device_only))
        f = 6 * n_params * sum(lens) + 6 * geo["layers"] * geo["heads"] * geo["head_dim"] * sum(l * l for l in lens)
        if step >= a.warmup:
            times.append(dt)
            flops.append(f)
            gc_times.append(watch.take())
    probe_after = host_probe_ms()
    device_row = {}
    if busy:  # --busy: each measured step's device time, in all and by kernel class (medians over the steps)
        steps_s = [round(sum(b.values()), 4) for b in busy]
        device_row = {"device_s": round(statistics.median(steps_s), 4), "device_s_steps": steps_s,
                      "device_s_by_class": {c: round(statistics.median(b.get(c, 0.0) for b in busy), 4)
                                            for c in sorted({c for b in busy for c in b})}}
    sm_mhz = gpu_sm_mhz() if cuda else None
    watch.close()  # and unfrozen, if this row froze
    gc.enable()
    state = torch.cuda.memory_allocated() if cuda else 0  # between steps: weights, grads, optimizer state
    del be
    gc.collect()  # megatron's DDP hooks and config callbacks hold the model in reference cycles:
    # without a collection the next row of this process starts with the last one's weights and
    # optimizer state still on the GPU (measured: 26 GiB left over, and false OOMs)
    t = statistics.median(times)
    f = statistics.median(flops)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = a.peak_tflops * 1e12 if a.peak_tflops else next((v for k, v in PEAK_BF16.items() if k in name), 989e12)
    return {"shape": shape, "backend": backend, "variant": variant, "gpus": world, "tokens_per_gpu": tokens,
            "step_s": round(t, 4), "step_times": [round(x, 4) for x in times],
            "gc_s": [round(x, 4) for x in gc_times], "cpu_mhz": cpu_mhz(),
            "host_probe_ms": [probe_before, probe_after], "gpu_sm_mhz": sm_mhz, **device_row,
            "tokens_per_s": round(tokens * world / t), "tflops_per_gpu": round(f / t / 1e12, 1),
            "mfu": round(f / t / peak, 4), "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None,
            # the allocator's reserve and its cudaMalloc retries (a retry frees every cached block and synchronises)
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 1) if cuda else None,
            "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else None,
            "state_mem_gib": round(state / 2**30, 1) if cuda else None,
            "state_bytes_per_param": round(state / total_params(model_dir), 2) if cuda else None, "device": name}


def chrome_trace(prof) -> dict:
    """A finished torch.profiler's chrome trace, as polyrl.metrics' readers take it."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        return json.load(open(f.name))


def device_time(prof) -> dict[str, float]:
    """{kernel class: device s} of one profiled step (polyrl.metrics.device_classes over its chrome trace)."""
    from polyrl.metrics import device_classes
    return {c: s for c, (s, _) in device_classes(chrome_trace(prof)).items()}


def cpu_mhz() -> float | None:
    """The host cores' mean clock now (/proc/cpuinfo), or None: a host-bound step slows when it drops."""
    try:
        mhz = [float(line.split(":")[1]) for line in open("/proc/cpuinfo") if line.startswith("cpu MHz")]
    except OSError:
        return None
    return round(sum(mhz) / len(mhz)) if mhz else None


def host_probe_ms() -> float:
    """The best of 5 runs of a fixed host workload (Python calls and small CPU tensor ops, what launching a step's
    kernels costs the host), in ms: when a host-bound step slows and this does too, the host is slower, not the step's
    code. /proc/cpuinfo's clock cannot say so inside a VM (it reads the nominal clock)."""
    import torch
    x = torch.ones(8)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(2000):
            x = (x * 1.0001).add_(1e-6)
            sorted({j: str(j) for j in range(20)}.items())
        best = min(best, time.perf_counter() - t0)
    return round(best * 1e3, 2)


def gpu_sm_mhz() -> int | None:
    """The GPU's SM clock now (NVML through torch), or None where NVML is missing."""
    import torch
    try:
        return int(torch.cuda.clock_rate())
    except Exception:  # no pynvml / amdsmi
        return None


def print_profile(prof, step_s: float) -> None:
    """Top kernels by GPU time, top ops by host time, and the Python lines that launch the most
    host time: a step whose GPU busy time is far below its wall time is launch (CPU) bound."""
    ka = prof.key_averages()
    busy = sum(e.self_device_time_total for e in ka) / 1e6
    print(f"step {step_s:.3f} s, GPU busy {busy:.3f} s ({busy / step_s:.0%}), ops launched "
          f"{sum(e.count for e in ka if e.key.startswith('aten::'))}", flush=True)
    print(ka.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=60), flush=True)
    print(ka.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60), flush=True)
    print(prof.key_averages(group_by_stack_n=6).table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60,
                                                       max_src_column_width=110), flush=True)
    from polyrl.metrics import idle_table
    print(idle_table(chrome_trace(prof), top=20), flush=True)  # where the GPU waited, by the code that ended each wait


def isolated(a, argv: list[str] | None, shape: str, model_dir: str, row: str) -> dict:
    """One row in a fresh process on this machine (one rank; the row's JSON comes back through a file)."""
    import subprocess
    import sys
    import torch.distributed as dist
    if dist.get_world_size() > 1:
        raise ValueError("--isolate runs single-process rows; drop it under torchrun")
    keep, skip = [], False
    for x in (argv if argv is not None else sys.argv[1:]):  # this command less its rows, shapes, output and --isolate
        if skip and not x.startswith("--"):
            continue
        skip = x in ("--rows", "--model-shape", "--out", "--train-backend", "--variants", "--tokens", "--model-dir")
        if not skip and x != "--isolate":
            keep.append(x)
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as f:
        cmd = [sys.executable, os.path.abspath(__file__), *keep, "--model-shape", shape, "--model-dir", model_dir,
               "--rows", row, "--out", f.name]
        subprocess.run(cmd, check=True, timeout=1800)
        return json.loads(open(f.name).read().splitlines()[-1])


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch
    import torch.distributed as dist

    from polyrl.dist import init_distributed, set_host_threads
    init_distributed(a.device)
    set_host_threads(a.device, dist.get_world_size())  # as polyrl train sets them
    rows = []
    box = [tempfile.mkdtemp(prefix="polyrl_bench_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)  # every rank reads the model rank 0 wrote
    tmp = box[0]
    for shape in a.model_shape:
        model_dir = a.model_dir or os.path.join(tmp, shape)
        if dist.get_rank() == 0 and not a.model_dir:
            make_model(shape, model_dir)
        dist.barrier()
        plan = ([(b, v, int(t)) for b, v, t in (r.split(":") for r in a.rows)] if a.rows else
                [(a.train_backend, v, t) for t in a.tokens for v in a.variants.split(",")])
        for backend, variant, tokens in plan:
            try:
                rows.append(isolated(a, argv, shape, model_dir, f"{backend}:{variant}:{tokens}") if a.isolate
                            else run_one(a, shape, model_dir, tokens, variant, backend))
            except Exception as e:  # an OOM (or a failing row) is reported in its row; the next rows still run
                oom = isinstance(e, torch.OutOfMemoryError)
                rows.append({"shape": shape, "backend": backend, "variant": variant, "tokens_per_gpu": tokens,
                             "gpus": dist.get_world_size(), "error": "OOM" if oom else f"{type(e).__name__}: {e}"[:300]})
                if dist.get_rank() == 0:
                    print(f"{'OOM' if oom else 'ERROR'}: {str(e).splitlines()[0][:300] if str(e) else type(e).__name__}",
                          flush=True)
                gc.collect()
            if a.device == "cuda":
                torch.cuda.empty_cache()
            if dist.get_rank() == 0:
                print(json.dumps(rows[-1]), flush=True)
    if dist.get_rank() == 0:
        cols = ["shape", "backend", "variant", "gpus", "tokens_per_gpu", "step_s"] + (["device_s"] if a.busy else []) + [
                "host_probe_ms", "gpu_sm_mhz", "tokens_per_s",
                "tflops_per_gpu", "mfu",
                "peak_mem_gib", "peak_reserved_gib", "alloc_retries", "state_mem_gib", "state_bytes_per_param"]
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
        for r in rows:
            print("| " + " | ".join(str(r.get(c, r.get("error", ""))) for c in cols) + " |")
        print(f"MFU against dense BF16 peak {rows[0].get('device', '')}: 989 TFLOP/s (H100 SXM / H200)")
        if a.out:
            with open(a.out, "a") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
