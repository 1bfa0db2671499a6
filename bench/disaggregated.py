"""Disaggregated rollout: trainer (FSDP) on GPU 0, a `polyrl serve` engine on GPU 1.

Part 1, weight sync from distributed, per model shape:
  sync     `DistributedTransport.push(backend.export_weights(), engine, version)`, built as
           `polyrl train --rollout-engine server` builds it (polyrl.assemble: build_backend / build_engine /
           build_transport): FSDP gather, bucketing, `/update_weights_from_distributed` per bucket,
           NCCL broadcast, the server's copy into its engine
  raw      a plain NCCL broadcast of the same buckets (same bytes, same bucket size) between two
           fresh processes on the same two GPUs: the floor for moving those bytes
Part 2 (--grpo), the GRPO step a user runs, same model and settings, three placements:
  embedded-colocated   --rollout-engine embedded on GPU 0 (in-process tensor sync)
  server-disaggregated --rollout-engine server, trainer GPU 0, engine GPU 1 (NCCL sync)
  server-colocated     --rollout-engine server with one visible GPU (engine releases its memory while training)
  server-disagg-async  as server-disaggregated, plus --async (one-step-off: step k+1 generates and is scored
                       while step k trains; --max-staleness 1)
  embedded-async       as embedded-colocated, plus --async: one GPU, generation on the rollout thread beside
                       training (the weight update waits for a running generate: they share one process)
and prints the median step time (time/step: wall time between two steps' logs), its parts,
train_rollout_logprob_abs_diff per step, and how busy each GPU was over steps 2..N: nvidia-smi's
utilization (share of time a kernel ran), sampled every 100 ms while the run logged its steps.

  python bench/disaggregated.py --model-shapes qwen2.5-0.5b,qwen2.5-1.5b --grpo qwen2.5-0.5b
  python bench/disaggregated.py --device cpu --model-shapes tiny --grpo tiny      (the same code on CPU, gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SHAPES, build_model_dir, fmt, markdown_table, median  # noqa: E402


# placement -> (extra flags, CUDA_VISIBLE_DEVICES)
PLACEMENTS = {"embedded-colocated": ([], "0"), "server-disaggregated": (["--rollout-engine", "server"], "0,1"),
              "server-colocated": (["--rollout-engine", "server"], "0"),
              "server-disagg-async": (["--rollout-engine", "server", "--async"], "0,1"),
              "embedded-async": (["--async"], "0")}


class GpuBusy:
    """nvidia-smi's per-GPU utilization every 100 ms, kept only while `metrics` has at least one line (steps 2..N)."""

    def __init__(self, metrics: str):
        import threading
        self.metrics, self.samples = metrics, {}
        try:
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits",
                                          "-lms", "100"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                gpu, util = (int(x) for x in line.split(","))
            except ValueError:
                continue
            if os.path.exists(self.metrics) and os.path.getsize(self.metrics) > 0:
                self.samples.setdefault(gpu, []).append(util)

    def stop(self) -> dict:
        if self.proc is None:
            return {}
        self.proc.terminate()
        self.proc.wait(10)
        return {f"gpu{g}_busy": sum(u) / len(u) / 100 for g, u in sorted(self.samples.items()) if u}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/disaggregated.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--model-shapes", default="qwen2.5-0.5b,qwen2.5-1.5b")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bucket-mib", type=int, default=512)
    p.add_argument("--grpo", default="", help="shape for the GRPO placement comparison (empty: skip)")
    p.add_argument("--grpo-steps", type=int, default=4)
    p.add_argument("--placements", default=",".join(PLACEMENTS), help="GRPO placements to run, comma-separated")
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=0, help="GRPO part: samples per micro-batch (0: the whole step)")
    p.add_argument("--reward-sleep-ms", type=float, default=0.0,
                   help="GRPO part: a reward that waits this long per sample (a sandbox, a remote verifier) before scoring")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--raw-worker", nargs=4, metavar=("RANK", "PORT", "SIZES_JSON", "REPEATS"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.shapes = [s for s in a.model_shapes.split(",") if s]
    a.placement_list = [s for s in a.placements.split(",") if s]
    for s in a.placement_list:
        if s not in PLACEMENTS:
            p.error(f"unknown placement {s}; choose from {', '.join(PLACEMENTS)}")
    for s in a.shapes + ([a.grpo] if a.grpo else []):
        if s not in SHAPES:
            p.error(f"unknown shape {s}; choose from {', '.join(SHAPES)}")
    return a


def raw_worker(rank: int, port: int, sizes_json: str, repeats: int, device: str) -> None:
    """One side of the raw broadcast: the same buckets as the transport sends, rank 0 -> rank 1."""
    import torch
    import torch.distributed as dist
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(0)  # CUDA_VISIBLE_DEVICES picks the GPU
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    sizes = json.load(open(sizes_json))
    dev = "cuda" if device == "cuda" else "cpu"
    bufs = [torch.empty(n // 2, dtype=torch.bfloat16, device=dev) for n in sizes]
    times = []
    for it in range(repeats + 1):
        dist.barrier()
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for b in bufs:
            dist.broadcast(b, src=0)
        if device == "cuda":
            torch.cuda.synchronize()
        if it:
            times.append(time.perf_counter() - t)
    if rank == 0:
        print(json.dumps({"raw_s": median(times)}), flush=True)
    dist.destroy_process_group()


def raw_broadcast(sizes: list[int], repeats: int, device: str, work: str) -> float:
    from polyrl.rollout.http_engine import free_port
    path = os.path.join(work, "sizes.json")
    json.dump(sizes, open(path, "w"))
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": str(rank)} if device == "cuda" else {})}
        procs.append(subprocess.Popen([sys.executable, __file__, "--device", device, "--raw-worker", str(rank), str(port), path,
                                       str(repeats)], env=env, stdout=subprocess.PIPE, text=True))
    out = procs[0].communicate(timeout=600)[0]
    procs[1].wait(60)
    return json.loads(out.strip().splitlines()[-1])["raw_s"]


def sync_shape(shape: str, a: argparse.Namespace, work: str) -> dict:
    import torch

    from polyrl import assemble as asm
    from polyrl.placement import plan_here
    from polyrl.config import Config
    from polyrl.weight_sync import buckets

    model_dir = os.path.join(work, shape)
    if a.device == "cuda":
        with torch.device("cuda"):
            info = build_model_dir(model_dir, shape)
        torch.cuda.empty_cache()
    else:
        info = build_model_dir(model_dir, shape)
    cfg = Config()
    cfg.model.hf_checkpoint = model_dir
    cfg.model.update_weight_buffer_size = a.bucket_mib * 2**20
    cfg.cluster.device = a.device
    cfg.rollout.rollout_engine = "server"
    cfg.engines.rollout_num_engines = 1
    cfg.log.run_dir = os.path.join(work, f"run_{shape}")
    device, _ = asm.setup_command(cfg)
    backend = asm.build_backend(cfg, device, total_steps=1, need_ref=False)
    engine = asm.build_engine(cfg, plan_here(cfg))
    transport = asm.build_transport(cfg, plan_here(cfg))
    try:
        t = time.perf_counter()
        nbytes = transport.push(backend.export_weights(), engine, version=1)  # forms the group
        first_s = time.perf_counter() - t
        times = []
        for v in range(a.repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            transport.push(backend.export_weights(), engine, version=2 + v)
            times.append(time.perf_counter() - t)
        export = []  # the trainer-side part alone: FSDP gather of every parameter into the HF-named stream
        for _ in range(a.repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            for _, x in backend.export_weights():
                x.contiguous()
            if device == "cuda":
                torch.cuda.synchronize()
            export.append(time.perf_counter() - t)
        sizes = [sum(x.numel() * x.element_size() for _, x in b)
                 for b in buckets(((n, x) for n, x in backend.export_weights()), cfg.model.update_weight_buffer_size)]
    finally:
        engine.close()
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    raw = raw_broadcast(sizes, a.repeats, a.device, work)
    s = median(times)
    return {"shape": shape, "params_M": info["params"] / 1e6, "GiB": nbytes / 2**30, "buckets": len(sizes),
            "first_sync_s": first_s, "sync_s": s, "export_s": median(export), "raw_broadcast_s": raw, "sync_GB_s": nbytes / s / 1e9,
            "raw_GB_s": sum(sizes) / raw / 1e9, "sync_over_raw": s / raw,
            "transfer_over_raw": (s - median(export)) / raw}


def grpo(a: argparse.Namespace, work: str) -> list[dict]:
    from polyrl.tasks.arithmetic import write_datasets
    model_dir = os.path.join(work, "grpo_" + a.grpo)
    if not os.path.isdir(model_dir):
        build_model_dir(model_dir, a.grpo)
    data = write_datasets(os.path.join(work, "data"), digits=2, n_train=2048, n_eval=16, seed=0)
    reward = ["--rm-type", "arithmetic"]
    if a.reward_sleep_ms:
        rm = os.path.join(work, "slow_reward.py")
        with open(rm, "w") as f:
            f.write("import time\nfrom polyrl.rewards import resolve_reward_fn\nSCORE = resolve_reward_fn('arithmetic', None)\n\n"
                    "def slow(sample):\n"
                    f"    time.sleep({a.reward_sleep_ms / 1000!r})\n    return SCORE(sample)\n")
        reward = ["--custom-rm-path", f"{rm}:slow"]
    common = ["--hf-checkpoint", model_dir, "--prompt-data", data["train"], *reward, "--quiet",
              "--rollout-batch-size", str(a.prompts_per_step), "--n-samples-per-prompt", str(a.samples_per_prompt),
              "--rollout-max-response-len", str(a.max_new_tokens), "--num-rollout", str(a.grpo_steps),
              "--micro-batch-size", str(a.micro_batch_size or a.prompts_per_step * a.samples_per_prompt), "--lr", "1e-6", "--device", a.device]
    rows = []
    for name in a.placement_list:
        extra, vis = PLACEMENTS[name]
        run = os.path.join(work, name)
        shutil.rmtree(run, ignore_errors=True)  # a reused --workdir: metrics.jsonl must hold this run's steps only
        env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": vis} if a.device == "cuda" else {})}
        busy = GpuBusy(os.path.join(run, "metrics.jsonl")) if a.device == "cuda" else None
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "polyrl", "train", *common, *extra, "--run-dir", run], env=env,
                           capture_output=True, text=True, timeout=1200)
        gpu_busy = busy.stop() if busy else {}
        if r.returncode:
            print(r.stderr[-3000:], file=sys.stderr)
            rows.append({"placement": name, "error": r.returncode})
            continue
        m = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
        steady = m[1:] or m
        row = {"placement": name, "wall_s": time.perf_counter() - t,
               "step_s": median([x["time/step"] for x in steady]), **gpu_busy,
               **{k: median([x.get(k, x.get(k + "_overlapped", 0.0)) for x in steady])
                  for k in ("time/rollout", "time/reward", "time/train", "time/weight_sync", "time/wait_rollout")},
               "logprob_diff_per_step": [round(x["train_rollout_logprob_abs_diff"], 5) for x in m]}
        rows.append(row)
    return rows


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.raw_worker:
        rank, port, sizes, repeats = a.raw_worker
        return raw_worker(int(rank), int(port), sizes, int(repeats), a.device)
    work = a.workdir or tempfile.mkdtemp(prefix="polyrl_disagg_")
    import torch
    dev = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    print(f"device: {dev} x {torch.cuda.device_count() if a.device == 'cuda' else 1}, torch {torch.__version__}", flush=True)
    sync_rows = [sync_shape(s, a, work) for s in a.shapes]
    print("\nweight sync from distributed (trainer GPU 0 -> polyrl serve GPU 1)\n")
    print(markdown_table(["shape", "params M", "GiB", "buckets", "first sync s", "sync s", "of it export s", "raw broadcast s", "sync GB/s",
                          "raw GB/s", "sync / raw", "(sync - export) / raw"],
                         [[r["shape"], fmt(r["params_M"], "{:.0f}"), fmt(r["GiB"], "{:.2f}"), r["buckets"],
                           fmt(r["first_sync_s"], "{:.3f}"), fmt(r["sync_s"], "{:.3f}"), fmt(r["export_s"], "{:.3f}"), fmt(r["raw_broadcast_s"], "{:.3f}"),
                           fmt(r["sync_GB_s"], "{:.1f}"), fmt(r["raw_GB_s"], "{:.1f}"), fmt(r["sync_over_raw"], "{:.2f}"),
                           fmt(r["transfer_over_raw"], "{:.2f}")]
                          for r in sync_rows]))
    grpo_rows = grpo(a, work) if a.grpo else []
    if grpo_rows:
        print(f"\nGRPO step, {a.grpo}, {a.prompts_per_step} prompts x {a.samples_per_prompt} samples x {a.max_new_tokens} "
              f"new tokens, reward sleep {a.reward_sleep_ms:g} ms/sample, median of steps 2..{a.grpo_steps}\n")
        print("(async: rollout and reward run on the rollout thread, overlapped; wait = the trainer waiting for them)\n")
        print(markdown_table(["placement", "step s", "rollout s", "reward s", "train s", "weight sync s", "wait s", "GPU0 busy",
                              "GPU1 busy", "train/rollout logprob diff per step"],
                             [[r["placement"], *([fmt(r.get(k), "{:.3f}") for k in ("step_s", "time/rollout", "time/reward",
                                                                                     "time/train", "time/weight_sync",
                                                                                     "time/wait_rollout")]),
                               fmt(r.get("gpu0_busy"), "{:.0%}"), fmt(r.get("gpu1_busy"), "{:.0%}"),
                               str(r.get("logprob_diff_per_step", r.get("error")))] for r in grpo_rows]))
    if a.out:
        json.dump({"sync": sync_rows, "grpo": grpo_rows}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
