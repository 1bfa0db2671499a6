"""The GRPO step under `polyrl train --use-ray` beside the same run without Ray, on one GPU.

Modes (each one `polyrl train` subprocess, the same flags and seeds):
  plain            the embedded engine in the trainer's process
  ray_colocate     --use-ray --colocate: the same, inside a Ray train actor holding the GPU
  server           --rollout-engine server: a launched `polyrl serve` on the trainer's GPU (they take turns; gloo sync)
  ray_server       --use-ray --colocate --rollout-engine server: a train actor and an engine actor on half a GPU each

Per mode: wall_s (the whole command), start_s (wall_s less the steps' own time: imports, Ray's start, actors, model
loads, engine start-up and teardown), step_s (median time/step over the steps after the first) and the step's
rollout and train parts. Ray's figures are the overhead a user pays; the step itself should not change.

  python bench/ray_step.py --out runs/bench/ray_step.json      # about 3-4 minutes on one H200 (0.5B shape)
  python bench/ray_step.py --quick                             # CPU smoke: tiny model, 2 steps per mode
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import build_model_dir, fmt, markdown_table, write_json  # noqa: E402

MODES = {"plain": [], "ray_colocate": ["--use-ray", "--colocate"], "server": ["--rollout-engine", "server"],
         "ray_server": ["--use-ray", "--colocate", "--rollout-engine", "server"]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model, 2 steps")
    p.add_argument("--model-shape", default=None, help="default qwen2.5-0.5b (tiny with --quick)")
    p.add_argument("--steps", type=int, default=None, help="steps per mode (default 5; 2 with --quick)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--timeout", type=float, default=300, help="seconds one mode may take")
    p.add_argument("--out", default="runs/bench/ray_step.json")
    a = p.parse_args(argv)
    a.device = "cpu" if a.quick else "cuda"
    a.model_shape = a.model_shape or ("tiny" if a.quick else "qwen2.5-0.5b")
    a.steps = a.steps or (2 if a.quick else 5)
    a.mode_list = [m for m in a.modes.split(",") if m]
    if any(m not in MODES for m in a.mode_list):
        p.error(f"--modes: choose from {', '.join(MODES)}")
    if a.steps < 2:
        p.error("--steps must be >= 2: the first step is not counted")
    return a


def run_mode(a, mode: str, model_dir: str, data: str, root: str) -> dict:
    run = os.path.join(root, mode)
    argv = [sys.executable, "-m", "polyrl", "train", "--hf-checkpoint", model_dir, "--prompt-data", data,
            "--rm-type", "arithmetic", "--rollout-batch-size", "8" if a.quick else "32", "--n-samples-per-prompt", "4",
            "--rollout-max-response-len", "8" if a.quick else "256", "--num-rollout", str(a.steps), "--seed", "1",
            "--device", a.device, "--quiet", "--run-dir", run, "--lr", "1e-6", *MODES[mode]]
    if a.device == "cuda":
        argv += ["--bf16", "--rollout-mem-fraction", "0.3"]
    env = {**os.environ, "RAY_ADDRESS": "", "RAY_AUTH_MODE": "disabled"}
    t0 = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True, timeout=a.timeout, env=env, cwd=root)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{mode}: polyrl train exited {res.returncode}:\n{(res.stdout + res.stderr)[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    steps = [r["time/step"] for r in rows]

    def med(key):
        xs = [r[key] for r in rows[1:] if key in r]
        return statistics.median(xs) if xs else None
    return {"mode": mode, "wall_s": wall, "start_s": wall - sum(steps), "step_s": statistics.median(steps[1:]),
            "rollout_s": med("time/rollout"), "train_s": med("time/train"), "reward": rows[-1].get("reward/mean")}


def main(argv=None) -> dict:
    a = parse_args(argv)
    import torch

    from polyrl.tasks.arithmetic import write_datasets
    if a.device == "cuda":
        assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU (or --quick)"
    root = tempfile.mkdtemp(prefix="ray_step_")
    res: dict = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "torch": torch.__version__,
                 "date": time.strftime("%Y-%m-%d"), "args": vars(a),
                 "model": build_model_dir(os.path.join(root, "model"), a.model_shape, seed=0), "modes": []}
    data = write_datasets(os.path.join(root, "data"), digits=2, n_train=512, n_eval=8, seed=0)["train"]
    for m in a.mode_list:
        res["modes"].append(run_mode(a, m, os.path.join(root, "model"), data, root))
        write_json(a.out, res)  # each mode as it ends
        print(f"{m}: step {res['modes'][-1]['step_s']:.3f} s, start {res['modes'][-1]['start_s']:.1f} s", flush=True)
    by = {m["mode"]: m for m in res["modes"]}
    rows = []
    for m in res["modes"]:
        ref = by.get("server" if "server" in m["mode"] else "plain")
        rows.append([m["mode"], fmt(m["step_s"], "{:.3f}"), fmt(m["step_s"] / ref["step_s"] if ref else None, "{:.2f}x"),
                     fmt(m["rollout_s"], "{:.3f}"), fmt(m["train_s"], "{:.3f}"), fmt(m["start_s"], "{:.1f}"),
                     fmt(m["wall_s"], "{:.1f}")])
    print(f"{a.model_shape}, {res['device']}; median of steps 2-{a.steps}; vs: the same engine without Ray")
    print(markdown_table(["mode", "step_s", "vs", "rollout_s", "train_s", "start_s", "wall_s"], rows))
    write_json(a.out, res)
    return res


if __name__ == "__main__":
    main()
