"""`make demo`: build a tiny model and an arithmetic task, warm-start with `polyrl sft`,
improve with `polyrl train` (GRPO), and compare held-out accuracy before and after."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

from polyrl.tasks.arithmetic import build_model, write_datasets


def polyrl(*args: str) -> None:
    cmd = [sys.executable, "-m", "polyrl", *args]
    print("$ polyrl " + " ".join(args), flush=True)
    quiet = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}  # no per-load progress bars
    subprocess.run(cmd, check=True, env={**os.environ, **quiet})


def sft_args(base: str, paths: dict, out: str, run_dir: str, *, epochs: int, seed: int) -> list[str]:
    """`polyrl sft` of the demo: the noisy demonstrations (write_datasets' paths) into the HF directory `out`."""
    return ["sft", "--hf-checkpoint", base, "--prompt-data", paths["sft"], "--global-batch-size", "64", "--micro-batch-size",
            "64", "--num-epoch", str(epochs), "--lr", "1e-3", "--lr-warmup-steps", "20", "--lr-decay-style", "cosine",
            "--min-lr", "1e-4", "--adam-beta2", "0.98", "--weight-decay", "0.0", "--save-hf", out, "--run-dir", run_dir,
            "--seed", str(seed), "--quiet"]


def train_args(sft_dir: str, paths: dict, run_dir: str, *, steps: int, seed: int, advantage_estimator: str = "grpo",
               eval_interval: int = 10) -> list[str]:
    """`polyrl train` of the demo (grpo, or gae: PPO with a learned critic, the SFT model's body with a fresh value
    head), with a held-out eval before the first step, every `eval_interval` steps and after the last."""
    # PPO's critic learns faster than the policy may move: from a zero head, its values must catch up with the returns
    critic = (["--advantage-estimator", "gae", "--critic-lr", "1e-3", "--lambd", "0.95"]
              if advantage_estimator == "gae" else [])
    return ["train", "--hf-checkpoint", sft_dir, "--prompt-data", paths["train"], "--rm-type", "arithmetic",
            "--rollout-batch-size", "32", "--n-samples-per-prompt", "8", "--rollout-max-response-len", "8",
            "--rollout-temperature", "1.0", "--num-rollout", str(steps), "--micro-batch-size", "64", "--lr", "1e-4",
            "--adam-beta2", "0.98", "--rollout-shuffle", "--use-kl-loss", "--kl-loss-coef", "0.001", "--eval-prompt-data",
            paths["eval"], "--eval-interval", str(eval_interval), "--run-dir", run_dir, *critic, "--seed", str(seed), "--quiet"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--run-dir", default="runs/demo")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sft-epochs", type=int, help="epochs of the SFT phase (default 15)")
    p.add_argument("--grpo-steps", type=int, default=60)
    p.add_argument("--digits", type=int, default=2)
    p.add_argument("--carry-bug-rate", type=float, default=0.6, help="share of SFT demos that forget the carry")
    p.add_argument("--sft-model", help="start RL from this SFT'd model (an earlier demo run's sft_model directory) "
                   "instead of running the SFT phase; the data are written from --seed as always")
    p.add_argument("--advantage-estimator", default="grpo", choices=("grpo", "gae"),
                   help="grpo, or gae: PPO with a learned critic (the SFT model's body with a fresh value head)")
    a = p.parse_args(argv)
    if a.sft_model:  # checked before the run dir is cleared
        if a.sft_epochs is not None:
            p.error("--sft-epochs with --sft-model: the SFT phase does not run; drop one")
        if not os.path.isfile(os.path.join(a.sft_model, "config.json")):
            p.error(f"--sft-model {a.sft_model}: no config.json there (give an earlier demo run's sft_model directory)")
    t0 = time.perf_counter()
    run = a.run_dir
    shutil.rmtree(run, ignore_errors=True)
    paths = write_datasets(os.path.join(run, "data"), seed=a.seed, digits=a.digits,
                           carry_bug_rate=a.carry_bug_rate)
    base, sft_dir, rl_dir = (os.path.join(run, x) for x in ("base_model", "sft_model", "grpo_model"))
    common = ["--seed", str(a.seed)]  # of the evals, which have no live view to quiet
    if a.sft_model:
        sft_dir = a.sft_model
    else:
        build_model(base, seed=a.seed)
        epochs = 15 if a.sft_epochs is None else a.sft_epochs
        polyrl(*sft_args(base, paths, sft_dir, os.path.join(run, "sft"), epochs=epochs, seed=a.seed))
    evals = ["--eval-prompt-data", paths["eval"], "--rm-type", "arithmetic", "--rollout-max-response-len", "8"]
    polyrl("eval", "--hf-checkpoint", sft_dir, *evals, "--run-dir", os.path.join(run, "eval_before"), *common)
    polyrl(*train_args(sft_dir, paths, run, steps=a.grpo_steps, seed=a.seed, advantage_estimator=a.advantage_estimator),
           "--save-hf", rl_dir)
    polyrl("eval", "--hf-checkpoint", rl_dir, *evals, "--run-dir", os.path.join(run, "eval_after"), *common)
    polyrl("plot", run)
    before = json.load(open(os.path.join(run, "eval_before", "eval.json")))["eval/accuracy"]
    after = json.load(open(os.path.join(run, "eval_after", "eval.json")))["eval/accuracy"]
    summary = {"eval_accuracy_before": before, "eval_accuracy_after": after, "steps": a.grpo_steps,
               "advantage_estimator": a.advantage_estimator,
               "wall_seconds": round(time.perf_counter() - t0, 1), "seed": a.seed, "plot": os.path.join(run, "curves.png")}
    with open(os.path.join(run, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    from rich.console import Console
    from rich.table import Table
    t = Table(title="held-out accuracy (200 unseen additions, greedy)")
    for c in ("model", "accuracy"):
        t.add_column(c)
    t.add_row("after SFT (noisy demos)", f"{before:.1%}")
    algo = "GRPO" if a.advantage_estimator == "grpo" else "PPO + critic (GAE)"
    t.add_row(f"after {algo} ({a.grpo_steps} steps)", f"{after:.1%}")
    t.add_row("change", f"{after - before:+.1%}")
    Console().print(t)
    print(f"summary: {json.dumps(summary)}")
    return 0


if __name__ == "__main__":
    from polyrl.cpu_env import apply_cpu_defaults, governable
    # before build_model imports torch. The polyrl commands it runs choose their own wait (a governed CPU run each, see
    # polyrl.cpu_env.start_process) unless this environment fixes it; then they inherit the passive one
    if not governable(os.environ, ["polyrl", "train"]):
        apply_cpu_defaults()
    sys.exit(main())
