"""polyrl vs TRL's GRPOTrainer, side by side: same model, prompts, reward and GRPO settings.

Each framework runs in a subprocess of its own (so its peak RSS / peak GPU memory is its
own), one after the other:

  polyrl    `polyrl train` (the CLI's `main`, in the worker process), steps timed from
            RUN_DIR/metrics.jsonl (sum of the time/* fields of a step)
  trl       `trl.GRPOTrainer`, generation with transformers `generate`, steps timed by a
            TrainerCallback (on_step_begin -> on_step_end)
  trl-cb    the same with TRL's transformers continuous-batching generation (GPU only)

The task is `polyrl.tasks.arithmetic` (addition prompts, reward 1.0 when the completion,
stripped, equals the sum). Both start from the same local HF directory: the tiny arithmetic
model (or a Qwen2.5-shaped model with random weights), optionally SFT-warm-started with
`polyrl sft` first. Settings that are made equal: prompts per step, samples per prompt (the
GRPO group), max new tokens, temperature 1.0 (top-p 1, no top-k), lr (constant schedule,
AdamW betas 0.9/0.999, eps 1e-8, no weight decay, grad clip 1.0), beta (KL to the reference,
k3 estimator), PPO clip 0.2, token-mean loss (TRL `dapo`), group-std reward scaling, one
optimizer step per generation batch, the same micro-batch size, no gradient checkpointing,
seed, and the prompts' order (no shuffling). TRL runs without vLLM.

  python bench/compare_trl.py --device cpu --steps 10 --warmup 3 --sft-warmstart-epochs 5 \\
      --out runs/bench/compare_trl.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ContentionProbe, build_model_dir, wait_for_quiet, fmt, markdown_table, median, write_json  # noqa: E402

FRAMEWORKS = ("polyrl", "trl", "trl-cb")
INSTALL_HINT = "TRL is not installed: `pip install -e .[bench]` (adds trl and psutil)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/compare_trl.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model-shape", choices=("tiny", "qwen2.5-0.5b"), default="tiny",
                   help="tiny: polyrl.tasks.arithmetic.build_model; qwen2.5-0.5b: that shape, random weights (GPU)")
    p.add_argument("--frameworks", default="polyrl,trl,trl-cb",
                   help=f"comma list of {','.join(FRAMEWORKS)} (trl-cb: TRL + transformers continuous batching, GPU only)")
    p.add_argument("--steps", type=int, default=10, help="measured steps (after the warm-up)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps, not measured")
    p.add_argument("--reward-last-k", type=int, default=5, help="mean reward over the last K steps")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the frameworks this many times, alternating (polyrl, trl, polyrl, trl, ...); "
                        "step times pool the measured steps of all runs")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="before each run, wait up to this long for the machine's CPUs to be idle (shared machines)")
    p.add_argument("--retry-busy", type=float, default=0.0, metavar="FRACTION",
                   help="rerun (at most 3 times) a run during which other processes used more than this share "
                        "of the CPUs (0 = off)")
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--samples-per-prompt", type=int, default=8, help="GRPO group size (TRL num_generations)")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=64,
                   help="samples per forward/backward (polyrl --micro-batch-size; TRL per_device_train_batch_size, "
                        "with gradient_accumulation_steps = prompts x samples / this)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (polyrl --use-kl-loss --kl-loss-coef; TRL beta)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--digits", type=int, default=2, help="digits of each addend in the arithmetic prompts")
    p.add_argument("--sft-warmstart-epochs", type=int, default=0,
                   help="SFT the model with `polyrl sft` first (0 = start from random weights)")
    p.add_argument("--workdir", default=None, help="models, data and run dirs (default: a new temp dir)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--dry-run", action="store_true", help="print the plan (both frameworks' settings) and exit")
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_spec", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.framework_list = [f.strip() for f in a.frameworks.split(",") if f.strip()]
    bad = [f for f in a.framework_list if f not in FRAMEWORKS]
    if bad:
        p.error(f"--frameworks: unknown {', '.join(bad)}; choose from {', '.join(FRAMEWORKS)}")
    per_step = a.prompts_per_step * a.samples_per_prompt
    a.micro_batch_size = min(a.micro_batch_size, per_step)
    if a.micro_batch_size < 1 or per_step % a.micro_batch_size:
        p.error(f"--micro-batch-size {a.micro_batch_size} must divide prompts x samples ({per_step}): TRL's "
                "gradient_accumulation_steps is their quotient")
    if a.samples_per_prompt < 2:
        p.error("--samples-per-prompt must be >= 2 (GRPO needs a group)")
    if a.steps < 1 or a.warmup < 0 or a.repeats < 1:
        p.error("--steps and --repeats must be >= 1 and --warmup >= 0")
    return a


# ---- settings, one place for both frameworks --------------------------------------------------------------
def polyrl_argv(s: dict) -> list[str]:
    argv = ["train", "--hf-checkpoint", s["model_dir"], "--prompt-data", s["train_data"], "--rm-type", "arithmetic",
            "--rollout-batch-size", str(s["prompts_per_step"]), "--n-samples-per-prompt", str(s["samples_per_prompt"]),
            "--rollout-max-response-len", str(s["max_new_tokens"]), "--rollout-temperature", "1.0",
            "--num-rollout", str(s["total_steps"]), "--micro-batch-size", str(s["micro_batch_size"]),
            "--lr", str(s["lr"]), "--lr-decay-style", "constant", "--adam-beta1", "0.9", "--adam-beta2", "0.999",
            "--adam-eps", "1e-8", "--weight-decay", "0.0", "--clip-grad", "1.0", "--eps-clip", "0.2",
            "--loss-agg-mode", "token-mean", "--advantage-estimator", "grpo", "--no-rollout-shuffle",
            "--seed", str(s["seed"]), "--rollout-seed", str(s["seed"]), "--device", s["device"],
            "--run-dir", s["run_dir"], "--quiet"]
    if s["beta"] > 0:
        argv += ["--use-kl-loss", "--kl-loss-coef", str(s["beta"]), "--kl-loss-type", "k3"]
    return argv


def trl_config_kwargs(s: dict, continuous_batching: bool = False, cb_field: str | None = None) -> dict:
    per_step = s["prompts_per_step"] * s["samples_per_prompt"]
    cuda = s["device"] == "cuda"
    kw = dict(
        output_dir=s["run_dir"], seed=s["seed"], max_steps=s["total_steps"],
        per_device_train_batch_size=s["micro_batch_size"], gradient_accumulation_steps=per_step // s["micro_batch_size"],
        num_generations=s["samples_per_prompt"], max_completion_length=s["max_new_tokens"],
        temperature=1.0, top_p=1.0, top_k=0, learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0,
        beta=s["beta"], epsilon=0.2, loss_type="dapo", scale_rewards="group", num_iterations=1,
        use_vllm=False, gradient_checkpointing=False, shuffle_dataset=False,
        bf16=cuda, fp16=False, use_cpu=not cuda, model_init_kwargs={"dtype": "float32"},
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, log_completions=False,
        dataloader_num_workers=0, remove_unused_columns=False,
    )
    if continuous_batching:
        kw[cb_field or "use_transformers_continuous_batching"] = True
    return kw


def trl_cb_field() -> tuple[str | None, str]:
    """The installed TRL's continuous-batching flag, or (None, why not)."""
    try:
        from trl import GRPOConfig
    except ImportError:
        return None, INSTALL_HINT
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    for name in ("use_transformers_continuous_batching", "use_transformers_paged"):
        if name in names:
            return name, ""
    return None, "this TRL version has no transformers continuous-batching option"


# ---- workers (each in its own process) ----------------------------------------------------------------------
def _peak_memory(device: str) -> dict:
    import resource
    out = {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # Linux: KiB
    if device == "cuda":
        import torch
        out["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def run_polyrl(s: dict) -> dict:
    from polyrl.cli import main as polyrl_main

    t0 = time.perf_counter()
    rc = polyrl_main(polyrl_argv(s))
    if rc != 0:
        raise RuntimeError(f"polyrl train exited {rc}")
    wall = time.perf_counter() - t0
    rows = [json.loads(l) for l in open(os.path.join(s["run_dir"], "metrics.jsonl")) if l.strip()]
    n = s["prompts_per_step"] * s["samples_per_prompt"]
    steps = []
    for r in rows:
        parts = {k[len("time/"):]: v for k, v in r.items() if k.startswith("time/")}
        steps.append({"step": int(r["step"]), "step_s": sum(parts.values()), "gen_s": parts.get("rollout"),
                      "parts": parts, "completion_tokens": r["response_len/mean"] * n, "reward": r["reward/mean"]})
    return {"steps": steps, "wall_s": wall, **_peak_memory(s["device"])}


def run_trl(s: dict, continuous_batching: bool) -> dict:
    try:
        import torch
        from datasets import Dataset
        from transformers import AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    from polyrl.tasks.arithmetic import reward as arithmetic_reward
    from polyrl.types import Sample

    if s["device"] == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)  # as polyrl does for one rank
    cb_field = trl_cb_field()[0] if continuous_batching else None
    rows = [json.loads(l) for l in open(s["train_data"]) if l.strip()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "label": str(r["label"])} for r in rows])

    def arithmetic(completions, label, **_):
        """polyrl.tasks.arithmetic.reward on each completion: 1.0 when completion.strip() == label."""
        return [arithmetic_reward(Sample([], [], [], "", response=c, label=l)) for c, l in zip(completions, label)]

    per_step = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if s["device"] == "cuda":
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if s["device"] == "cuda":
                torch.cuda.synchronize()
            per_step.append({"step": state.global_step, "step_s": time.perf_counter() - self.t0})

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs and per_step:
                per_step[-1]["reward"] = logs["reward"]
                per_step[-1]["completion_tokens"] = logs.get("completions/mean_length", float("nan")) * (
                    s["prompts_per_step"] * s["samples_per_prompt"])

    tok = AutoTokenizer.from_pretrained(s["model_dir"], padding_side="left")
    cfg = GRPOConfig(**trl_config_kwargs(s, continuous_batching, cb_field))
    trainer = GRPOTrainer(model=s["model_dir"], reward_funcs=[arithmetic], args=cfg, train_dataset=dataset,
                          processing_class=tok, callbacks=[StepTimer()])
    gen_times: list[float] = []
    inner = trainer._generate_and_score_completions

    def timed(*a, **k):  # generation + reward + (reference) log-probs of one generation batch
        t = time.perf_counter()
        out = inner(*a, **k)
        gen_times.append(time.perf_counter() - t)
        return out

    trainer._generate_and_score_completions = timed
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    for st, g in zip(per_step, gen_times):
        st["gen_s"] = g
    return {"steps": per_step, "wall_s": wall, **_peak_memory(s["device"])}


def worker_main(framework: str, spec_path: str) -> int:
    import logging
    import warnings
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    with open(spec_path) as f:
        s = json.load(f)
    res = run_polyrl(s) if framework == "polyrl" else run_trl(s, continuous_batching=framework == "trl-cb")
    write_json(s["result_path"], res)
    return 0


# ---- parent: prepare, run each, report -----------------------------------------------------------------------
def summarize(framework: str, results: list[dict], s: dict, prompt_tokens: list[int]) -> dict:
    """One row from one or more runs of a framework: warm-up steps dropped from each run, the
    measured steps pooled; the reward is the mean of each run's last K steps."""
    w, k = s["warmup"], s["reward_last_k"]
    measured, runs = [], []
    for res in results:
        steps = sorted(res["steps"], key=lambda r: r["step"])
        measured += steps[w:]
        runs.append({"per_step": steps, "step_s_median": median([r["step_s"] for r in steps[w:]]),
                     "reward_last_k": sum(r.get("reward", float("nan")) for r in steps[-k:]) / max(len(steps[-k:]), 1),
                     "other_cpu_frac": res.get("other_cpu_frac"), "peak_rss_mib": res.get("peak_rss_mib"),
                     "peak_gpu_mib": res.get("peak_gpu_mib"), "wall_s": res.get("wall_s")})
    step_s = [r["step_s"] for r in measured]
    gen_tok = [r.get("completion_tokens", float("nan")) for r in measured]
    trained = [t + prompt_tokens[(r["step"] - 1) % len(prompt_tokens)] for t, r in zip(gen_tok, measured)]
    others = [r["other_cpu_frac"] for r in runs if r["other_cpu_frac"] is not None]
    peak = lambda key: max((r[key] for r in runs if r.get(key) is not None), default=None)  # noqa: E731
    row = {
        "framework": framework, "runs": len(runs), "steps_measured": len(measured), "warmup": w,
        "step_s_median": median(step_s),
        "gen_s_median": median([r["gen_s"] for r in measured if r.get("gen_s") is not None]),
        "gen_tokens_per_s": sum(gen_tok) / sum(step_s) if step_s else float("nan"),
        "trained_tokens_per_s": sum(trained) / sum(step_s) if step_s else float("nan"),
        "completion_tokens_per_step": median(gen_tok),
        "reward_last_k": sum(r["reward_last_k"] for r in runs) / len(runs),
        "peak_rss_mib": peak("peak_rss_mib"), "peak_gpu_mib": peak("peak_gpu_mib"),
        "other_cpu_frac": max(others) if others else None,
    }
    if framework == "polyrl":
        keys = sorted({p for r in measured for p in r.get("parts", {})})
        row["parts_median_s"] = {p: median([r["parts"].get(p, 0.0) for r in measured]) for p in keys}
    row["run_details"] = runs
    return row


def prepare(a: argparse.Namespace, work: str) -> dict:
    """Data, model and (optionally) the SFT warm start; reused from an earlier run in the same
    --workdir when the settings that shape them are the same."""
    import shutil

    from polyrl.tasks.arithmetic import write_datasets

    key = {"model_shape": a.model_shape, "seed": a.seed, "digits": a.digits, "sft_warmstart_epochs": a.sft_warmstart_epochs,
           "device": a.device}
    marker = os.path.join(work, "prepared.json")
    if os.path.isfile(marker):
        with open(marker) as f:
            done = json.load(f)
        if done.get("key") == key and os.path.isdir(done["prep"]["model_dir"]):
            print(f"reusing the prepared model and data in {work} ({done['prep']['model_dir']})")
            return done["prep"]

    data = write_datasets(os.path.join(work, "data"), digits=a.digits, seed=a.seed)
    base = os.path.join(work, f"model_{a.model_shape}")
    shutil.rmtree(base, ignore_errors=True)
    t = time.perf_counter()
    info = build_model_dir(base, a.model_shape, seed=a.seed)
    print(f"model: {a.model_shape}, {info['params'] / 1e6:.2f}M params, built in {time.perf_counter() - t:.1f}s -> {base}")
    if info["tokenizer_decoder_fixed"]:
        print("note: the arithmetic tokenizer decoded '579' as '5 7 9'; gave it a concatenating decoder (see RESULTS.md)")
    model_dir = base
    sft_s = None
    if a.sft_warmstart_epochs > 0:
        model_dir = os.path.join(work, "sft_model")
        cmd = [sys.executable, "-m", "polyrl", "sft", "--hf-checkpoint", base, "--prompt-data", data["sft"],
               "--global-batch-size", "64", "--micro-batch-size", "64", "--num-epoch", str(a.sft_warmstart_epochs),
               "--lr", "1e-3", "--lr-warmup-steps", "20", "--lr-decay-style", "cosine", "--min-lr", "1e-4",
               "--adam-beta2", "0.98", "--save-hf", model_dir, "--run-dir", os.path.join(work, "sft_run"),
               "--seed", str(a.seed), "--device", a.device, "--quiet"]
        print(f"SFT warm start: polyrl sft, {a.sft_warmstart_epochs} epochs ...", flush=True)
        t = time.perf_counter()
        subprocess.run(cmd, check=True)
        sft_s = time.perf_counter() - t
        print(f"SFT warm start done in {sft_s:.1f}s -> {model_dir} (both frameworks start here)")
    prep = {"data": data, "model_dir": model_dir, "model_info": info, "sft_seconds": sft_s}
    write_json(marker, {"key": key, "prep": prep})
    return prep


def prompt_tokens_per_step(model_dir: str, train_path: str, prompts_per_step: int, samples: int, steps: int) -> list[int]:
    """Prompt tokens trained per step (the same prompts, in file order, for both frameworks)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [json.loads(l)["prompt"] for l in open(train_path) if l.strip()]
    out = []
    for k in range(steps):
        idx = [(k * prompts_per_step + i) % len(prompts) for i in range(prompts_per_step)]
        out.append(samples * sum(len(tok(prompts[i])["input_ids"]) for i in idx))
    return out


def print_table(rows: list[dict], device: str) -> str:
    mem_key, mem_name = ("peak_gpu_mib", "peak GPU MiB") if device == "cuda" else ("peak_rss_mib", "peak RSS MiB")
    headers = ["framework", "step s (median)", "gen phase s", "gen tok/s", "trained tok/s", mem_name, "reward (last K)",
               "other CPU load"]
    body = []
    ok = [r for r in rows if "error" not in r and "skipped" not in r]
    for r in rows:
        if "skipped" in r or "error" in r:
            body.append([r["framework"], "skipped" if "skipped" in r else "failed", "", "", "", "", "", ""])
            continue
        body.append([r["framework"], fmt(r["step_s_median"], "{:.3f}"), fmt(r["gen_s_median"], "{:.3f}"),
                     fmt(r["gen_tokens_per_s"], "{:.0f}"), fmt(r["trained_tokens_per_s"], "{:.0f}"),
                     fmt(r.get(mem_key), "{:.0f}"), fmt(r["reward_last_k"], "{:.3f}"),
                     fmt(r["other_cpu_frac"] * 100 if r.get("other_cpu_frac") is not None else None, "{:.0f}%")])
    pol = next((r for r in ok if r["framework"] == "polyrl"), None)
    for r in ok:
        if pol is None or r is pol:
            continue
        ratio = lambda key: (pol[key] / r[key]) if pol.get(key) and r.get(key) else float("nan")  # noqa: E731
        body.append([f"polyrl / {r['framework']}", fmt(ratio("step_s_median"), "{:.2f}x"), fmt(ratio("gen_s_median"), "{:.2f}x"),
                     fmt(ratio("gen_tokens_per_s"), "{:.2f}x"), fmt(ratio("trained_tokens_per_s"), "{:.2f}x"),
                     fmt(ratio(mem_key), "{:.2f}x"), fmt(pol["reward_last_k"] - r["reward_last_k"], "{:+.3f}"), ""])
    table = markdown_table(headers, body)
    notes = [f"{r['framework']}: {'skipped: ' + r['skipped'] if 'skipped' in r else 'failed: ' + r['error']}"
             for r in rows if "skipped" in r or "error" in r]
    if notes:
        table += "\n\n" + "\n".join(notes)
    print(table)
    return table


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a._worker:
        return worker_main(a._worker, a._spec)
    want_trl = any(f.startswith("trl") for f in a.framework_list)
    plan = {"device": a.device, "model_shape": a.model_shape, "prompts_per_step": a.prompts_per_step,
            "samples_per_prompt": a.samples_per_prompt, "max_new_tokens": a.max_new_tokens, "lr": a.lr, "beta": a.beta,
            "seed": a.seed, "micro_batch_size": a.micro_batch_size, "warmup": a.warmup, "steps": a.steps,
            "total_steps": a.warmup + a.steps, "reward_last_k": a.reward_last_k, "frameworks": a.framework_list,
            "repeats": a.repeats, "wait_quiet": a.wait_quiet, "retry_busy": a.retry_busy, "digits": a.digits, "sft_warmstart_epochs": a.sft_warmstart_epochs,
            "model_dir": "<workdir>/model", "train_data": "<workdir>/data/train.jsonl", "run_dir": "<workdir>/<framework>"}
    if a.dry_run:
        print(json.dumps({"plan": plan, "polyrl_argv": polyrl_argv(plan), "trl_grpo_config": trl_config_kwargs(plan)}, indent=1))
        return 0
    import importlib.util
    if want_trl and importlib.util.find_spec("trl") is None:
        print(f"compare_trl: error: {INSTALL_HINT}", file=sys.stderr)
        return 2
    if a.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            print("compare_trl: error: --device cuda but no CUDA device is visible", file=sys.stderr)
            return 2
    import shutil
    work = a.workdir or tempfile.mkdtemp(prefix="polyrl_compare_trl_")
    os.makedirs(work, exist_ok=True)
    print(f"workdir: {work}")
    prep = prepare(a, work)
    ptoks = prompt_tokens_per_step(prep["model_dir"], prep["data"]["train"], a.prompts_per_step, a.samples_per_prompt,
                                   a.warmup + a.steps)
    runnable, rows_by_fw = [], {}
    for fw in a.framework_list:
        why = None
        if fw == "trl-cb":
            if a.device != "cuda":
                why = "transformers continuous batching (paged attention) is a GPU path; not run on CPU"
            elif trl_cb_field()[0] is None:
                why = trl_cb_field()[1]
        if why:
            print(f"skip {fw}: {why}")
            rows_by_fw[fw] = {"framework": fw, "skipped": why}
        else:
            runnable.append(fw)
    results: dict[str, list[dict]] = {fw: [] for fw in runnable}
    specs = {}
    for rep in range(a.repeats):
        for fw in runnable:
            if fw in rows_by_fw:  # failed before
                continue
            s = {**plan, "model_dir": prep["model_dir"], "train_data": prep["data"]["train"],
                 "run_dir": os.path.join(work, f"{fw}_run{rep}"), "result_path": os.path.join(work, f"{fw}_result{rep}.json")}
            specs[fw] = s
            spec = os.path.join(work, f"{fw}_spec{rep}.json")
            write_json(spec, s)
            for attempt in range(4 if a.retry_busy > 0 else 1):
                if a.wait_quiet > 0:
                    share = wait_for_quiet(a.wait_quiet)
                    if share is not None and share >= 0.08:
                        print(f"    machine still {share:.0%} busy after --wait-quiet {a.wait_quiet:.0f}s; running anyway")
                shutil.rmtree(s["run_dir"], ignore_errors=True)  # polyrl appends to metrics.jsonl
                print(f"--- {fw} (run {rep + 1}/{a.repeats}{f', retry {attempt}' if attempt else ''}): "
                      f"{a.warmup} warm-up + {a.steps} measured steps ...", flush=True)
                with ContentionProbe() as probe:
                    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--_worker", fw, "--_spec", spec],
                                          capture_output=True, text=True)
                busy = probe.other_frac is not None and probe.other_frac > (a.retry_busy or 0.05)
                if busy:
                    print(f"    other processes used {probe.other_frac:.0%} of the CPUs during this run; its timings are inflated"
                          + ("; rerunning" if a.retry_busy > 0 and attempt < 3 and proc.returncode == 0 else ""))
                if proc.returncode != 0 or not (busy and a.retry_busy > 0):
                    break
            if proc.returncode != 0:
                err = (proc.stderr or proc.stdout).strip().splitlines()
                print(f"{fw} failed (exit {proc.returncode}):\n" + "\n".join(err[-30:]), file=sys.stderr)
                rows_by_fw[fw] = {"framework": fw, "error": err[-1] if err else f"exit {proc.returncode}"}
                continue
            with open(s["result_path"]) as f:
                res = json.load(f)
            res["other_cpu_frac"] = probe.other_frac
            results[fw].append(res)
            one = summarize(fw, [res], s, ptoks)
            load = f", other CPU load {probe.other_frac:.0%}" if probe.other_frac is not None else ""
            print(f"    done in {probe.wall:.1f}s: step {one['step_s_median']:.3f}s, reward(last {a.reward_last_k}) "
                  f"{one['reward_last_k']:.3f}{load}" + (f", polyrl parts {json.dumps({k: round(v, 3) for k, v in one['parts_median_s'].items()})}"
                                                         if "parts_median_s" in one else ""), flush=True)
    for fw in runnable:
        if fw not in rows_by_fw:
            rows_by_fw[fw] = summarize(fw, results[fw], specs[fw], ptoks)
    rows = [rows_by_fw[fw] for fw in a.framework_list]
    print()
    table = print_table(rows, a.device)
    import platform
    try:
        import torch
        import transformers
        versions = {"torch": torch.__version__, "transformers": transformers.__version__}
        if want_trl:
            import trl
            versions["trl"] = trl.__version__
    except ImportError:
        versions = {}
    out = {"settings": plan, "model": prep["model_info"], "sft_seconds": prep["sft_seconds"], "rows": rows,
           "table": table, "versions": versions, "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
           "command": " ".join(["python bench/compare_trl.py", *(argv if argv is not None else sys.argv[1:])])}
    if a.out:
        write_json(a.out, out)
        print(f"\nwrote {a.out}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
