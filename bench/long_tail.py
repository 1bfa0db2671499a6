"""The GRPO step on long-tailed response lengths: the synchronous rollout, --partial-rollout with over-sampling, and
--async with --partial-rollout, side by side in one run.

Random-weight models never emit EOS, so the lengths come from the length-controlled workload
(--rollout-length-distribution: every sample's response ends with EOS at a length drawn from a lognormal with the
given median and p99, capped; polyrl/rollout/lengths.py). The default is DAPO-like: a Qwen2.5-0.5B shape, 64 prompts
x 8 samples, median 1024, p99 8192, cap 8192 tokens. Each mode is one `polyrl train` in this process (its own engine
and trainer, one GPU, the embedded engine); the first --warmup steps are not counted (graph captures, compiles, and
for partial rollout the buffer filling up). Per mode, the median over the measured steps of:

  step_s        wall time of a step (time/step)
  rollout_s     the step's rollout: generation and scoring (--async: on the rollout thread, overlapping training)
  gpu_busy      the share of the rollout's wall time the engine's GPU kernels ran (prefill + decode, CUDA events)
  occ_mean      sequences decoding per decode step, mean; occupancy: the same in each tenth of the rollout
  gen_tok_s     tokens generated per second of rollout (the cut ones included); train_tok_s: tokens trained / rollout_s
  (rollout_s here is the step's collect call, generation and scoring, measured around it for every mode)

  python bench/long_tail.py --out runs/bench/long_tail.json            # about 4 minutes on one H200
  python bench/long_tail.py --quick        # CPU smoke: the tiny model, 4 x 4, short lengths, 3 steps per mode
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import build_model_dir, fmt, markdown_table, write_json  # noqa: E402

MODES = ("sync", "partial", "async_partial")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model, small sizes")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda, or cpu with --quick)")
    p.add_argument("--model-shape", default=None, help="default qwen2.5-0.5b (tiny with --quick)")
    p.add_argument("--prompts", type=int, default=None, help="--rollout-batch-size (default 64; 4 with --quick)")
    p.add_argument("--samples", type=int, default=None, help="--n-samples-per-prompt (default 8; 4 with --quick)")
    p.add_argument("--over-sampling", type=float, default=2.0, help="prompts in flight / --prompts for partial rollout")
    p.add_argument("--lengths", default=None, help="--rollout-length-distribution (default "
                   "lognormal:median=1024,p99=8192,cap=8192; median=6,p99=20,cap=24 with --quick)")
    p.add_argument("--steps", type=int, default=None, help="steps per mode, warm-up included (default 3)")
    p.add_argument("--warmup", type=int, default=None, help="steps not counted (default 1)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--mem-fraction", type=float, default=0.55, help="--rollout-mem-fraction (the KV cache)")
    p.add_argument("--out", default="runs/bench/long_tail.json")
    p.add_argument("--model-dir", default=None, help="reuse a model directory (default: a fresh temporary one)")
    a = p.parse_args(argv)
    q = a.quick
    a.device = a.device or ("cpu" if q else "cuda")
    a.model_shape = a.model_shape or ("tiny" if q else "qwen2.5-0.5b")
    a.prompts = a.prompts or (4 if q else 64)
    a.samples = a.samples or (4 if q else 8)
    a.lengths = a.lengths or ("lognormal:median=6,p99=20,cap=24" if q else "lognormal:median=1024,p99=8192,cap=8192")
    a.steps = a.steps or 3
    a.warmup = a.warmup if a.warmup is not None else 1
    a.mode_list = [m for m in a.modes.split(",") if m]
    if any(m not in MODES for m in a.mode_list):
        p.error(f"--modes: choose from {', '.join(MODES)}")
    if a.warmup >= a.steps:
        p.error("--warmup must be below --steps: nothing would be measured")
    if a.over_sampling < 1:
        p.error("--over-sampling must be >= 1")
    return a


def train_argv(a, model_dir: str, data: str, run_dir: str, mode: str, cap: int) -> list[str]:
    argv = ["train", "--hf-checkpoint", model_dir, "--prompt-data", data, "--rm-type", "arithmetic",
            "--rollout-batch-size", str(a.prompts), "--n-samples-per-prompt", str(a.samples),
            "--rollout-max-response-len", str(cap), "--rollout-length-distribution", a.lengths,
            "--num-rollout", str(a.steps), "--device", a.device, "--run-dir", run_dir, "--quiet", "--seed", "1",
            "--lr", "1e-6", "--rollout-mem-fraction", str(a.mem_fraction)]
    if a.device == "cuda":
        # micro-batches of a token budget, not of a sample count; eager: a compile per new micro-batch shape would
        # land in the measured steps at these varied lengths
        argv += ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "16384", "--bf16", "--no-compile"]
    if mode != "sync":
        over = max(a.prompts, round(a.prompts * a.over_sampling))
        argv += ["--partial-rollout", "--over-sampling-batch-size", str(over),
                 "--rollout-batch-generate", str(over * a.samples)]
    if mode == "async_partial":
        argv += ["--async"]
    return argv


class Probe:
    """Wraps the parts polyrl.loop builds: each step's rollout window (collect), the engine's occupancy trace, and
    (GPU path) its kernels' time per generate call."""

    def __init__(self):
        self.engine = None
        self.calls: list[dict] = []
        self.windows: dict[int, tuple[float, float]] = {}

    def attach(self, parts):
        eng = self.engine = parts.engine
        eng.trace = []
        if hasattr(eng, "profile"):
            eng.profile = eng.is_cuda  # CUDA events around prefill and decode steps (last_stats)
        generate, collect = eng.generate, parts.rollout.collect

        def timed_generate(*args, **kw):
            t0 = time.perf_counter()
            out = generate(*args, **kw)
            st = getattr(eng, "last_stats", {}) or {}
            self.calls.append({"t0": t0, "t1": time.perf_counter(),
                               "gpu_s": st.get("gpu_prefill_s", 0.0) + st.get("gpu_decode_s", 0.0),
                               "tokens": sum(len(s.response_ids) for s in out)})
            return out

        def timed_collect(step, timer):
            t0 = time.perf_counter()
            out = collect(step, timer)
            self.windows[step] = (t0, time.perf_counter())
            return out
        eng.generate, parts.rollout.collect = timed_generate, timed_collect
        return parts

    def step(self, k: int, row: dict, n_samples: int) -> dict:
        """Step k's rollout: its generate calls, occupancy and GPU busy share, from its collect window."""
        lo, hi = self.windows[k]
        rollout = hi - lo
        mine = [c for c in self.calls if lo <= c["t0"] and c["t1"] <= hi]
        occ = [b for t, b in (self.engine.trace or []) if lo <= t <= hi]
        n = len(occ)
        tenths = [round(statistics.mean(occ[i * n // 10:max((i + 1) * n // 10, i * n // 10 + 1)]), 1)
                  for i in range(10)] if n else []
        gpu = sum(c["gpu_s"] for c in mine)
        return {"step_s": row["time/step"], "rollout_s": rollout, "gpu_busy": gpu / rollout if gpu else None,
                "occ_mean": statistics.mean(occ) if occ else None, "occupancy": tenths,
                "gen_tok_s": sum(c["tokens"] for c in mine) / rollout,
                "train_tok_s": row["response_len/mean"] * n_samples / rollout,
                "response_len": row.get("response_len/mean"),
                "resumed_samples": row.get("partial_rollout/resumed_samples"),
                "aborted_samples": row.get("partial_rollout/aborted_samples"),
                "token_lag_mean": row.get("partial_rollout/token_lag_mean")}


def run_mode(a, model_dir: str, data: str, mode: str, cap: int, root: str) -> dict:
    import polyrl.loop
    import polyrl.loop_async
    from polyrl.cli import main as cli

    probe = Probe()
    module = polyrl.loop_async if mode == "async_partial" else polyrl.loop
    real = module.assemble
    module.assemble = lambda cfg, **kw: probe.attach(real(cfg, **kw))
    run_dir = os.path.join(root, mode)
    t0 = time.perf_counter()
    try:
        rc = cli(train_argv(a, model_dir, data, run_dir, mode, cap))
    finally:
        module.assemble = real
    wall = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"polyrl train ({mode}) exited with {rc}")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    rows = [r for r in rows if r.get("step", 0) >= 1 and "time/step" in r]
    steps = [probe.step(r["step"] - 1, r, a.prompts * a.samples) for r in rows][a.warmup:]

    def med(k):
        xs = [s[k] for s in steps if s[k] is not None]
        return statistics.median(xs) if xs else None
    occ = [statistics.mean(col) for col in zip(*[s["occupancy"] for s in steps if s["occupancy"]])]
    return {"mode": mode, "wall_s": wall, "steps": steps, **{k: med(k) for k in (
        "step_s", "rollout_s", "gpu_busy", "occ_mean", "gen_tok_s", "train_tok_s", "response_len", "token_lag_mean")},
        "occupancy": [round(x) for x in occ]}


def mode_in_child(argv, mode: str, model_dir: str, root: str) -> dict:
    """One mode in a process of its own: on a GPU a mode's engine and trainer leave cached and still-referenced memory
    that the next mode's KV cache cannot take in the same process."""
    import subprocess
    out = os.path.join(root, f"{mode}.json")
    cmd = [sys.executable, os.path.abspath(__file__), *(sys.argv[1:] if argv is None else argv),
           "--modes", mode, "--model-dir", model_dir, "--out", out]
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if res.returncode != 0:
        raise SystemExit(f"long_tail.py --modes {mode} exited {res.returncode}:\n{res.stdout[-4000:]}")
    with open(out) as f:
        return json.load(f)["modes"][0]


def main(argv=None) -> dict:
    a = parse_args(argv)
    if a.device == "cuda":
        # the engine sleeps between rollouts and re-takes its KV cache after training; at these lengths the training
        # activations refill the freed cache and pin it (a 74 GiB request failed with 71 GiB reserved but free), so
        # segments that can give back their free pages are asked for before CUDA starts
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch

    from polyrl.rollout.lengths import parse_length_distribution
    from polyrl.tasks.arithmetic import write_datasets

    if a.device == "cuda":
        assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU (or --quick / --device cpu)"
    dist = parse_length_distribution(a.lengths)
    root = tempfile.mkdtemp(prefix="long_tail_")
    mdir = a.model_dir or os.path.join(root, "model")
    res: dict = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "torch": torch.__version__,
                 "args": {k: v for k, v in vars(a).items()}, "date": time.strftime("%Y-%m-%d"),
                 "lengths": dist.describe()}
    if not os.path.exists(os.path.join(mdir, "config.json")):
        res["model"] = build_model_dir(mdir, a.model_shape, seed=0)
    data = write_datasets(os.path.join(root, "data"), digits=3, n_train=2048, n_eval=8, seed=0)["train"]
    res["modes"] = []
    for m in a.mode_list:
        if a.device == "cuda" and len(a.mode_list) > 1:
            res["modes"].append(mode_in_child(argv, m, mdir, root))
        else:
            res["modes"].append(run_mode(a, mdir, data, m, dist.cap, root))
        write_json(a.out, res)  # each mode as it ends: a run cut short keeps the modes it finished
        print(f"{m}: step {fmt(res['modes'][-1]['step_s'], '{:.2f}')} s, "
              f"rollout {fmt(res['modes'][-1]['rollout_s'], '{:.2f}')} s", flush=True)
    base = next((m for m in res["modes"] if m["mode"] == "sync"), None)
    rows = []
    for m in res["modes"]:
        rel = m["step_s"] / base["step_s"] if base and m["step_s"] and base["step_s"] else None
        rows.append([m["mode"], fmt(m["step_s"], "{:.2f}"), fmt(rel, "{:.2f}x"), fmt(m["rollout_s"], "{:.2f}"),
                     fmt(m["gpu_busy"], "{:.0%}") if m["gpu_busy"] is not None else "-", fmt(m["occ_mean"], "{:.0f}"),
                     " ".join(str(x) for x in m["occupancy"]), fmt(m["gen_tok_s"], "{:.0f}"),
                     fmt(m["train_tok_s"], "{:.0f}"), fmt(m["response_len"], "{:.0f}"), fmt(m["token_lag_mean"], "{:.2f}")])
    print(f"lengths: {dist.describe()}; {a.prompts} prompts x {a.samples}, {a.model_shape}, {res['device']}; "
          f"median of steps {a.warmup + 1}-{a.steps}")
    print(markdown_table(["mode", "step_s", "vs sync", "rollout_s", "gpu_busy", "occ_mean", "occupancy by tenth",
                          "gen_tok_s", "train_tok_s", "resp_len", "token_lag"], rows))
    write_json(a.out, res)
    return res


if __name__ == "__main__":
    main()
