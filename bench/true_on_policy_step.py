"""The GRPO step with and without --true-on-policy, in the same call: `polyrl train` on one GPU (or the CPU, --device
cpu, FP32), the Qwen2.5-0.5B shape (random weights), 16 prompts x 8 samples x 256 new tokens, default batching in both modes (`--exact-args` adds flags
to the exact run only, e.g. a micro-batch size, which does not change its arithmetic), bench/compare_trl.py's settings. Each
mode runs in a subprocess of its own; the figures are medians over the steps after the warm-up, read from its
metrics.jsonl: step, rollout (the engine's scoring passes included, rollout/score_s of them), train and weight-sync
seconds, and the log-prob mismatch (exactly 0 with the mode); on CUDA the peak memory of the run's process (the
largest over all steps, warm-up included: what must fit), and the step ratio again over the measured steps that
captured no CUDA graph (a scoring graph for a new pack shape can cost its step seconds).

  PYTHONPATH=. python3 bench/true_on_policy_step.py --out /tmp/top.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
from common import build_model_dir, markdown_table, median, write_json  # noqa: E402
from compare_trl import polyrl_argv  # noqa: E402

KEYS = ("time/step", "time/rollout", "rollout/generate_s", "rollout/score_s", "rollout/score_graph_captures",
        "time/train", "time/weight_sync", "tokens_per_s", "train_rollout_logprob_abs_diff_max",
        "rollout/sampler_logprob_abs_diff_max", "time/gc")
CAPTURES = ("rollout/graph_captures", "rollout/score_graph_captures", "rollout/score_graph_resets")
# the largest over every step, not the median: what must fit on the device
PEAKS = ("memory/peak_allocated_gib", "memory/peak_reserved_gib")
NOT_RUN = {k: float("nan") for k in KEYS + PEAKS + ("time/step_steady",)}  # a mode not run, or failed


def run_mode(a, model_dir: str, data: str, work: str, exact: bool) -> dict:
    run = os.path.join(work, "exact" if exact else "default")
    s = dict(model_dir=model_dir, train_data=data, prompts_per_step=a.prompts, samples_per_prompt=a.samples,
             max_new_tokens=a.new_tokens, total_steps=a.warmup + a.steps, polyrl_default_batching=True, lr=1e-6,
             seed=0, device=a.device, run_dir=run, beta=0.0,
             polyrl_args=" ".join([a.args] + (["--true-on-policy", a.exact_args] if exact else [])))
    argv = polyrl_argv(s)
    code = "import sys; from polyrl.cli import main; sys.exit(main(sys.argv[1:]))"
    res = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=a.timeout)
    for stream, text in (("stdout", res.stdout), ("stderr", res.stderr)):  # a --profile-step table, TORCH_LOGS
        log_path = os.path.join(run, f"{stream}.txt")
        with open(log_path, "w") as f:
            f.write(text)
        if a.keep:
            os.makedirs(a.keep, exist_ok=True)
            shutil.copy(log_path, os.path.join(a.keep, f"{'exact' if exact else 'default'}_{stream}.txt"))
    if res.returncode != 0:
        raise RuntimeError(f"{'exact' if exact else 'default'} run failed ({res.returncode}): {res.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    steps = [r for r in rows if r.get("step", 0) > a.warmup and "time/step" in r]
    out = {k: median([r[k] for r in steps if k in r]) for k in KEYS}
    out.update({k: max((r[k] for r in rows if k in r), default=float("nan")) for k in PEAKS})  # warm-up included
    out["steps_measured"] = len(steps)
    # steps that captured no CUDA graph (decode or scoring): a capture for a new shape costs the step up to seconds,
    # and a few measured steps can hold several, which moves the median
    steady = [r["time/step"] for r in steps if not any(r.get(k) for k in CAPTURES)]
    out["time/step_steady"], out["steps_steady"] = median(steady), len(steady)
    out["all_steps_diff_max"] = [r.get("train_rollout_logprob_abs_diff_max") for r in rows]
    per_step = ("step", "time/step", "time/rollout", "rollout/generate_s", "time/train", "time/gc", "rollout/score_s",
                "rollout/score_graph_captures", "rollout/score_graph_resets", "rollout/score_graph_capture_s",
                "rollout/score_graph_compiles",
                "rollout/graph_captures", "rollout/graph_capture_s", *PEAKS, "memory/alloc_retries")
    out["all_steps"] = [{k: r.get(k) for k in per_step} for r in rows if "time/step" in r]
    out["command"] = "polyrl " + " ".join(argv)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: FP32 on both runs (the mode's CPU "
                   "arithmetic), e.g. with --shape tiny")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per mode's run")
    p.add_argument("--out", default=None)
    p.add_argument("--modes", default="default,exact", help="which runs: default, exact or both (comma list)")
    p.add_argument("--exact-args", default="", help="more polyrl flags for the exact run (e.g. --profile-step 3)")
    p.add_argument("--args", default="", help="more polyrl flags for both runs (e.g. --profile-step 3)")
    p.add_argument("--keep", default=None, metavar="DIR",
                   help="copy each run's stdout.txt (its --profile-step table) and stderr.txt (TORCH_LOGS) here")
    a = p.parse_args()
    import torch
    from polyrl.tasks.arithmetic import write_datasets
    work = tempfile.mkdtemp(prefix="top_bench_")
    model_dir = os.path.join(work, "model")
    build_model_dir(model_dir, a.shape)
    data = write_datasets(os.path.join(work, "data"), digits=3, n_train=2000, n_eval=10, seed=0)["train"]
    if a.device == "cuda":
        device = torch.cuda.get_device_name(0)
    else:
        names = [ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")] \
            if os.path.exists("/proc/cpuinfo") else []
        device = f"CPU {names[0] if names else 'unknown'}, {os.cpu_count()} cores"
    result = {"device": device, "shape": a.shape, "setting": f"{a.prompts} prompts x {a.samples} samples x "
              f"{a.new_tokens} new tokens, median of {a.steps} steps after {a.warmup} warm-up"}
    wanted = set(a.modes.split(","))
    for name, exact in (("default", False), ("true_on_policy", True)):
        if ("exact" if exact else "default") not in wanted:
            result[name] = dict(NOT_RUN)
            continue
        try:
            result[name] = run_mode(a, model_dir, data, work, exact)
        except (RuntimeError, subprocess.TimeoutExpired) as e:  # the other mode still runs
            print(f"{name}: {e}", file=sys.stderr)
            result[name] = {"error": str(e)[-2000:], **NOT_RUN}
        if a.out:
            write_json(a.out, result)
    d, e = result["default"], result["true_on_policy"]
    result["step_ratio"] = e["time/step"] / d["time/step"] if d["time/step"] == d["time/step"] else float("nan")
    result["step_ratio_steady"] = (e["time/step_steady"] / d["time/step_steady"]
                                   if d["time/step_steady"] == d["time/step_steady"] else float("nan"))
    if a.out:
        write_json(a.out, result)
    f = lambda v: "-" if v is None or v != v else f"{v:.3g}"  # noqa: E731
    print(f"{device}, {a.shape}, {result['setting']}")
    cols = KEYS + PEAKS
    print(markdown_table(["mode", *cols], [[n, *(f(result[n][k]) for k in cols)] for n in ("default", "true_on_policy")]))
    print(f"step ratio (true-on-policy / default): {result['step_ratio']:.2f}; over the steps that captured no CUDA "
          f"graph: {result['step_ratio_steady']:.2f} ({d.get('steps_steady', 0)} / {e.get('steps_steady', 0)} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
