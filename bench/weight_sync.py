"""Weight sync into the colocated embedded engine, against the device's copy floor.

For each model shape (random weights from a config, saved with save_pretrained to a temp
dir), builds the FSDP train backend and the embedded rollout engine exactly as
`polyrl train` does (`polyrl.assemble: setup_command / build_backend / build_engine` from a Config)
and times

  push     `InMemoryTransport.push(backend.export_weights(), engine, version)`: gather each
           full parameter from FSDP, cast to the engine's dtype, copy into the engine's
           parameter (what the RL loop's `time/weight_sync` spends besides offload/wake)
  export   iterating `backend.export_weights()` alone (the gather/cast half of push)
  floor    `dst.copy_(src)` of one flat buffer of the same byte count on the same device:
           the practical floor of moving those bytes

  python bench/weight_sync.py --device cpu --model-shapes tiny,qwen2.5-0.5b
  python bench/weight_sync.py --device cuda --model-shapes qwen2.5-0.5b,qwen2.5-1.5b
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SHAPES, ContentionProbe, build_model_dir, fmt, markdown_table, median, wait_for_quiet, write_json  # noqa: E402

DEFAULT_SHAPES = {"cpu": "tiny,qwen2.5-0.5b", "cuda": "qwen2.5-0.5b,qwen2.5-1.5b"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/weight_sync.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model-shapes", default=None,
                   help=f"comma list of {', '.join(SHAPES)} (default: {DEFAULT_SHAPES['cpu']} on cpu, "
                        f"{DEFAULT_SHAPES['cuda']} on cuda)")
    p.add_argument("--repeats", type=int, default=5, help="timed pushes (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed pushes first")
    p.add_argument("--bucket-mib", type=int, default=512, help="InMemoryTransport bucket size (--update-weight-buffer-size)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="before each shape's timings, wait up to this long for the machine's CPUs to be idle")
    p.add_argument("--workdir", default=None, help="where the model directories go (default: a temp dir, removed)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    a = p.parse_args(argv)
    a.shapes = [s.strip() for s in (a.model_shapes or DEFAULT_SHAPES[a.device]).split(",") if s.strip()]
    bad = [s for s in a.shapes if s not in SHAPES]
    if bad:
        p.error(f"--model-shapes: unknown {', '.join(bad)}; choose from {', '.join(SHAPES)}")
    if a.repeats < 1 or a.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    return a


def _sync(device: str) -> None:
    if device == "cuda":
        import torch
        torch.cuda.synchronize()


def _timed(fn, device: str, warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t)
    return out


def bench_shape(shape: str, a: argparse.Namespace, work: str) -> dict:
    import torch

    from polyrl import assemble as asm
    from polyrl.placement import plan_here
    from polyrl.config import Config
    from polyrl.weight_sync import InMemoryTransport

    model_dir = os.path.join(work, shape)
    t = time.perf_counter()
    if a.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        with torch.device("cuda"):  # random init on the GPU: CPU init of 1.5B parameters takes tens of seconds
            info = build_model_dir(model_dir, shape, seed=a.seed)
        torch.cuda.empty_cache()
    else:
        info = build_model_dir(model_dir, shape, seed=a.seed)
    build_s = time.perf_counter() - t
    print(f"{shape}: {info['params'] / 1e6:.1f}M params, built in {build_s:.1f}s", flush=True)
    cfg = Config()
    cfg.model.hf_checkpoint = model_dir
    cfg.model.update_weight_buffer_size = a.bucket_mib * 2**20
    cfg.cluster.device = a.device
    cfg.cluster.seed = a.seed
    device, _ = asm.setup_command(cfg)
    t = time.perf_counter()
    backend = asm.build_backend(cfg, device, total_steps=1, need_ref=False)
    engine = asm.build_engine(cfg, plan_here(cfg))
    setup_s = time.perf_counter() - t
    print(f"{shape}: backend ({type(backend).__name__}) and engine ({type(engine).__name__}) built in {setup_s:.1f}s",
          flush=True)
    transport = InMemoryTransport(cfg.model.update_weight_buffer_size)
    version = [0]

    def push():
        version[0] += 1
        return transport.push(backend.export_weights(), engine, version=version[0])

    nbytes = push()

    def export_only():
        for _, t_ in backend.export_weights():
            pass

    dev = engine.device
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty_like(src)
    if a.wait_quiet > 0:
        wait_for_quiet(a.wait_quiet)
    with ContentionProbe(in_process=True) as probe:
        push_s = _timed(push, device, a.warmup, a.repeats)
        export_s = _timed(export_only, device, a.warmup, a.repeats)
        floor_s = _timed(lambda: dst.copy_(src), device, max(a.warmup, 1), a.repeats)
    engine_dtype = str(engine.dtype).replace("torch.", "")  # the GPU engine's model is a flat buffer, not an nn.Module
    engine_kind = type(engine).__name__
    peak_gpu_mib = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None
    backend = engine = transport = src = dst = None  # free before the next shape (the closures hold names)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    shutil.rmtree(model_dir, ignore_errors=True)
    p, f = median(push_s), median(floor_s)
    return {"shape": shape, "params": info["params"], "bytes": nbytes, "engine_dtype": engine_dtype, "engine": engine_kind,
            "build_s": build_s, "setup_s": setup_s, "peak_gpu_mib": peak_gpu_mib,
            "push_s": p, "export_s": median(export_s), "floor_s": f, "ratio": p / f if f > 0 else float("nan"),
            "push_gb_s": nbytes / p / 1e9, "floor_gb_s": nbytes / f / 1e9,
            "push_s_all": push_s, "export_s_all": export_s, "floor_s_all": floor_s, "other_cpu_frac": probe.other_frac}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.dry_run:
        print(f"plan: device={a.device} shapes={','.join(a.shapes)} repeats={a.repeats} warmup={a.warmup} "
              f"bucket={a.bucket_mib}MiB")
        return 0
    import torch
    if a.device == "cuda" and not torch.cuda.is_available():
        print("weight_sync: error: --device cuda but no CUDA device is visible", file=sys.stderr)
        return 2
    work = a.workdir or tempfile.mkdtemp(prefix="polyrl_weight_sync_")
    os.makedirs(work, exist_ok=True)
    rows, t0 = [], time.perf_counter()
    meta = {"device": a.device, "torch": torch.__version__,
            "command": " ".join(["bench/weight_sync.py", *(argv if argv is not None else sys.argv[1:])])}
    try:
        for shape in a.shapes:
            try:
                rows.append(bench_shape(shape, a, work))
            except Exception as e:  # keep the other shapes' rows
                import traceback
                traceback.print_exc()
                rows.append({"shape": shape, "error": f"{type(e).__name__}: {e}".splitlines()[0][:500]})
            gc.collect()  # outside the except block: its traceback no longer holds the failed shape's tensors
            if a.device == "cuda":
                torch.cuda.empty_cache()
            print(f"{shape}: done at {time.perf_counter() - t0:.1f}s", flush=True)
            if a.out:  # after every shape: a kill keeps what was measured
                write_json(a.out, {**meta, "rows": rows, "complete": False})
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    headers = ["shape", "params", "bytes", "engine dtype", "push s", "export-only s", "copy-floor s", "push/floor",
               "push GB/s", "floor GB/s", "other CPU load"]
    body = [[r["shape"], "failed: " + r["error"]] + [""] * (len(headers) - 2) if "error" in r else
            [r["shape"], f"{r['params'] / 1e6:.1f}M", f"{r['bytes'] / 2**20:.1f} MiB", r["engine_dtype"],
             fmt(r["push_s"], "{:.4f}"), fmt(r["export_s"], "{:.4f}"), fmt(r["floor_s"], "{:.4f}"),
             fmt(r["ratio"], "{:.1f}x"), fmt(r["push_gb_s"], "{:.2f}"), fmt(r["floor_gb_s"], "{:.2f}"),
             fmt(r["other_cpu_frac"] * 100 if r["other_cpu_frac"] is not None else None, "{:.0f}%")] for r in rows]
    print()
    table = markdown_table(headers, body)
    print(table)
    if a.out:
        import platform
        machine = {"cpus": os.cpu_count(), "platform": platform.platform()}
        if a.device == "cuda":
            machine["gpu"] = torch.cuda.get_device_name(0)
        write_json(a.out, {**meta, "rows": rows, "table": table, "machine": machine, "complete": True,
                           "elapsed_s": time.perf_counter() - t0})
        print(f"\nwrote {a.out}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
