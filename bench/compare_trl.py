"""polyrl vs TRL's GRPOTrainer, side by side: same model, prompts, reward and GRPO settings.

Each framework runs in a subprocess of its own (so its peak RSS / peak GPU memory is its
own), one after the other:

  polyrl    `polyrl train` (the CLI's `main`, in the worker process), steps timed by the
            loop's own metrics (time/step of RUN_DIR/metrics.jsonl: wall time between two steps' logs; before
            2026-11-23 the sum of the time/* phase fields)
  trl       `trl.GRPOTrainer`, generation with transformers `generate`, steps timed by a
            TrainerCallback (on_step_begin -> on_step_end)
  trl-cb    the same with TRL's transformers continuous-batching (paged KV cache) generation,
            GRPOConfig(use_transformers_continuous_batching=True) (`use_transformers_paged` before
            TRL 1.2); on CPU only when asked for with --frameworks (its paged cache takes half of RAM)

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

Time-bounded runs (one GPU call with a hard wall limit): --row-budget gives each framework's
worker process a wall budget (model load included); a worker stops after the step whose
successor would not end inside it, and is killed --kill-grace seconds after it. --deadline
caps the whole script (later rows get what is left). Workers write their steps to a JSON file
after every step, and the parent rewrites --out after every row, so a kill loses nothing
that was measured. A row with fewer steps than warm-up + 1 reports its warm-up steps, marked.

  python bench/compare_trl.py --device cuda --model-shape qwen2.5-0.5b --prompts-per-step 64 \\
      --samples-per-prompt 8 --max-new-tokens 512 --micro-batch-size 32 --warmup 2 --steps 8 \\
      --trl-warmup 1 --trl-steps 2 --reward-last-k 3 --row-budget polyrl=95,trl=170,trl-cb=150 \\
      --deadline 420 --kill-grace 20 --out runs/bench/compare_trl_gpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SHAPES, ContentionProbe, build_model_dir, wait_for_quiet, fmt, markdown_table, median, write_json  # noqa: E402

FRAMEWORKS = ("polyrl", "trl", "trl-cb")
DEFAULT_FRAMEWORKS = {"cpu": "polyrl,trl", "cuda": "polyrl,trl,trl-cb"}
STOP_TAIL_S = 3.0  # a worker's shutdown after its last step (TRL's end of train(), process-group teardown)
INSTALL_HINT = "TRL is not installed: `pip install -e .[bench]` (adds trl and psutil)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/compare_trl.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model-shape", choices=SHAPES, default="tiny",
                   help="tiny: polyrl.tasks.arithmetic.build_model; qwen2.5-*: that shape, random weights (GPU)")
    p.add_argument("--frameworks", default=None,
                   help=f"comma list of {','.join(FRAMEWORKS)} (trl-cb: TRL + transformers continuous batching); "
                        f"default {DEFAULT_FRAMEWORKS['cpu']} on cpu, {DEFAULT_FRAMEWORKS['cuda']} on cuda")
    p.add_argument("--steps", type=int, default=10, help="measured steps (after the warm-up)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps, not measured")
    p.add_argument("--trl-steps", type=int, default=None, help="measured steps of the TRL rows (default: --steps)")
    p.add_argument("--trl-warmup", type=int, default=None, help="warm-up steps of the TRL rows (default: --warmup)")
    p.add_argument("--row-budget", default="0", metavar="S | FW=S,...",
                   help="wall seconds each framework's worker may take, model load included (0 = no limit): one "
                        "number for all, or e.g. 'polyrl=90,trl=180,trl-cb=150' (a bare number sets the rest); the "
                        "worker stops after the last step that fits and is killed --kill-grace s after its budget")
    p.add_argument("--deadline", type=float, default=0.0, metavar="SECONDS",
                   help="wall seconds for the whole script from its start (0 = none): every row's budget is capped "
                        "by what is left, and a row with less than 20 s left is skipped")
    p.add_argument("--kill-grace", type=float, default=30.0, metavar="SECONDS",
                   help="kill a worker this long after its budget ran out (its last step overran); steps it wrote are kept")
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
    p.add_argument("--polyrl-default-batching", action="store_true",
                   help="polyrl rows: no --micro-batch-size, so polyrl's own default applies (on GPU token-budget "
                        "micro-batches); TRL keeps --micro-batch-size")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (polyrl --use-kl-loss --kl-loss-coef; TRL beta)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                   help="both frameworks: auto = BF16 compute on GPU, FP32 on CPU; bf16 on CPU = FP32 weights with "
                        "BF16 matmuls (polyrl --bf16, TRL bf16=True autocast), fast on CPUs with AMX")
    p.add_argument("--polyrl-args", default="", metavar="'FLAGS'",
                   help="extra `polyrl train` flags appended to polyrl's command line, e.g. '--rollout-mem-fraction 0.2' "
                        "(default: none, polyrl's defaults)")
    p.add_argument("--digits", type=int, default=2, help="digits of each addend in the arithmetic prompts")
    p.add_argument("--sft-warmstart-epochs", type=int, default=0,
                   help="SFT the model with `polyrl sft` first (0 = start from random weights)")
    p.add_argument("--workdir", default=None, help="models, data and run dirs (default: a new temp dir)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--dry-run", action="store_true", help="print the plan (both frameworks' settings) and exit")
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_spec", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.framework_list = [f.strip() for f in (a.frameworks or DEFAULT_FRAMEWORKS[a.device]).split(",") if f.strip()]
    bad = [f for f in a.framework_list if f not in FRAMEWORKS]
    if bad:
        p.error(f"--frameworks: unknown {', '.join(bad)}; choose from {', '.join(FRAMEWORKS)}")
    try:
        a.budgets = parse_budgets(a.row_budget)
    except ValueError as e:
        p.error(f"--row-budget: {e}")
    a.trl_steps = a.steps if a.trl_steps is None else a.trl_steps
    a.trl_warmup = a.warmup if a.trl_warmup is None else a.trl_warmup
    if a.trl_steps < 1 or a.trl_warmup < 0:
        p.error("--trl-steps must be >= 1 and --trl-warmup >= 0")
    if a.deadline < 0 or a.kill_grace < 0:
        p.error("--deadline and --kill-grace must be >= 0")
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


def parse_budgets(spec: str) -> dict[str, float]:
    """'120' -> every framework 120 s; 'polyrl=90,trl=180' -> those two (others unlimited); a bare
    number beside named ones sets the rest. 0 = no limit. Returns {framework or '*': seconds}."""
    out: dict[str, float] = {}
    for item in (x.strip() for x in (spec or "0").split(",")):
        if not item:
            continue
        fw, _, val = item.rpartition("=")
        fw = fw.strip() or "*"
        if fw != "*" and fw not in FRAMEWORKS:
            raise ValueError(f"unknown framework {fw!r}; choose from {', '.join(FRAMEWORKS)}")
        try:
            out[fw] = float(val)
        except ValueError:
            raise ValueError(f"{item!r} is not SECONDS or FRAMEWORK=SECONDS") from None
        if out[fw] < 0:
            raise ValueError(f"{item!r}: seconds must be >= 0")
    return out


def framework_plan(plan: dict, fw: str) -> dict:
    """The plan with this framework's warm-up / measured step counts (TRL rows may run fewer)."""
    if fw.startswith("trl"):
        w, n = plan.get("trl_warmup", plan["warmup"]), plan.get("trl_steps", plan["steps"])
        return {**plan, "warmup": w, "steps": n, "total_steps": w + n}
    return dict(plan)


# ---- settings, one place for both frameworks --------------------------------------------------------------
def polyrl_argv(s: dict) -> list[str]:
    argv = ["train", "--hf-checkpoint", s["model_dir"], "--prompt-data", s["train_data"], "--rm-type", "arithmetic",
            "--rollout-batch-size", str(s["prompts_per_step"]), "--n-samples-per-prompt", str(s["samples_per_prompt"]),
            "--rollout-max-response-len", str(s["max_new_tokens"]), "--rollout-temperature", "1.0",
            "--num-rollout", str(s["total_steps"]),
            *([] if s.get("polyrl_default_batching") else ["--micro-batch-size", str(s["micro_batch_size"])]),
            "--lr", str(s["lr"]), "--lr-decay-style", "constant", "--adam-beta1", "0.9", "--adam-beta2", "0.999",
            "--adam-eps", "1e-8", "--weight-decay", "0.0", "--clip-grad", "1.0", "--eps-clip", "0.2",
            "--loss-agg-mode", "token-mean", "--advantage-estimator", "grpo", "--no-rollout-shuffle",
            "--seed", str(s["seed"]), "--rollout-seed", str(s["seed"]), "--device", s["device"],
            "--run-dir", s["run_dir"], "--quiet"]
    if s.get("precision", "auto") == "bf16":
        argv += ["--bf16"]
    elif s.get("precision", "auto") == "fp32":
        argv += ["--fp32"]
    if s["beta"] > 0:
        argv += ["--use-kl-loss", "--kl-loss-coef", str(s["beta"]), "--kl-loss-type", "k3"]
    if s.get("polyrl_args"):
        import shlex
        argv += shlex.split(s["polyrl_args"])
    return argv


def trl_config_kwargs(s: dict, continuous_batching: bool = False, cb_field: str | None = None) -> dict:
    per_step = s["prompts_per_step"] * s["samples_per_prompt"]
    cuda = s["device"] == "cuda"
    bf16 = {"auto": cuda, "bf16": True, "fp32": False}[s.get("precision", "auto")]
    kw = dict(
        output_dir=s["run_dir"], seed=s["seed"], max_steps=s["total_steps"],
        per_device_train_batch_size=s["micro_batch_size"], gradient_accumulation_steps=per_step // s["micro_batch_size"],
        num_generations=s["samples_per_prompt"], max_completion_length=s["max_new_tokens"],
        temperature=1.0, top_p=1.0, top_k=0, learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0,
        beta=s["beta"], epsilon=0.2, loss_type="dapo", scale_rewards="group", num_iterations=1,
        use_vllm=False, gradient_checkpointing=False, shuffle_dataset=False,
        bf16=bf16, fp16=False, use_cpu=not cuda, model_init_kwargs={"dtype": "float32"},
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
    except Exception as e:  # e.g. a datasets / pyarrow mismatch: the TRL rows will fail with it too
        return None, f"importing trl failed: {type(e).__name__}: {e}"
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    for name in ("use_transformers_continuous_batching", "use_transformers_paged"):
        if name in names:
            return name, ""
    return None, "this TRL version has no transformers continuous-batching option"


# ---- workers (each in its own process) ----------------------------------------------------------------------
T_WORKER = time.perf_counter()  # the worker's clock starts at import (its budget counts model loading)


class BudgetStop(Exception):
    """Raised inside polyrl's loop (from its metrics logger) when the next step would not fit the budget."""


def _peak_memory(device: str) -> dict:
    import resource
    out = {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # Linux: KiB
    if device == "cuda":
        import torch
        if torch.cuda.is_initialized():
            out["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
            out["peak_gpu_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
            out["gpu_total_mib"] = torch.cuda.get_device_properties(0).total_memory / 2**20
            out["gpu_name"] = torch.cuda.get_device_name(0)
    return out


def _out_of_time(s: dict, last_step_s: float) -> bool:
    """True when one more step like the last would not end before this worker's deadline."""
    deadline = s.get("deadline_unix")
    return bool(deadline) and time.time() + 1.05 * last_step_s + STOP_TAIL_S > deadline


def _write_progress(s: dict, steps: list[dict], *, final: bool, stopped: str | None = None, extra: dict | None = None) -> None:
    """The worker's result file, rewritten after every step: a killed worker leaves what it measured."""
    write_json(s["result_path"], {"steps": steps, "wall_s": time.perf_counter() - T_WORKER, "final": final,
                                  "stopped": stopped, **(extra or {}), **_peak_memory(s["device"])})


def run_polyrl(s: dict) -> dict:
    from polyrl import metrics as polyrl_metrics
    from polyrl.cli import main as polyrl_main

    n = s["prompts_per_step"] * s["samples_per_prompt"]
    steps: list[dict] = []
    state = {"last": None, "stopped": None, "startup_s": None}
    original_log = polyrl_metrics.MetricsLogger.log

    def log(self, step, metrics):  # called by polyrl's loop once per step, after the step
        original_log(self, step, metrics)
        now = time.perf_counter()
        parts = {k[len("time/"):]: v for k, v in metrics.items() if k.startswith("time/") and k != "time/step"}
        # time/step: the loop's wall time between two steps' logs (every phase and what lies between them)
        steps.append({"step": int(step), "step_s": metrics.get("time/step", sum(parts.values())), "gen_s": parts.get("rollout"), "parts": parts,
                      "wall_step_s": now - state["last"] if state["last"] is not None else None,
                      "completion_tokens": metrics["response_len/mean"] * n, "reward": metrics["reward/mean"]})
        state["last"] = now
        if state["startup_s"] is None:  # imports, model load, engine build: the worker's time before step 1
            state["startup_s"] = now - T_WORKER - steps[0]["step_s"]
        _write_progress(s, steps, final=False, extra={"startup_s": state["startup_s"]})
        last = max(steps[-1]["step_s"], steps[-1]["wall_step_s"] or 0.0)
        # a warm-up step (compiling, graph capture, pinning host memory) does not predict a measured one: after it the
        # row goes on, and a measured step that overruns is killed with what was measured kept (a 7B row's 160 s
        # warm-up once stopped a row whose 9 s steps fitted)
        if step < s["total_steps"] and step > s["warmup"] and _out_of_time(s, last):
            state["stopped"] = f"row budget: stopped after step {step} of {s['total_steps']}"
            raise BudgetStop(state["stopped"])

    polyrl_metrics.MetricsLogger.log = log
    try:
        rc = polyrl_main(polyrl_argv(s))
        if rc != 0:
            raise RuntimeError(f"polyrl train exited {rc}")
    except BudgetStop:
        pass
    finally:
        polyrl_metrics.MetricsLogger.log = original_log
    return {"steps": steps, "stopped": state["stopped"], "startup_s": state["startup_s"]}


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

    cuda = s["device"] == "cuda"
    if not cuda:
        torch.set_num_threads(os.cpu_count() or 1)  # as polyrl does for one rank
    cb_field = trl_cb_field()[0] if continuous_batching else None
    rows = [json.loads(l) for l in open(s["train_data"]) if l.strip()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "label": str(r["label"])} for r in rows])

    def arithmetic(completions, label, **_):
        """polyrl.tasks.arithmetic.reward on each completion: 1.0 when completion.strip() == label."""
        return [arithmetic_reward(Sample([], [], [], "", response=c, label=l)) for c, l in zip(completions, label)]

    per_step: list[dict] = []
    gen_times: list[float] = []
    state = {"stopped": None, "startup_s": None}
    progress: dict = {}  # where the worker is, in its result file: a kill mid-step still says how far it got

    def write():
        _write_progress(s, per_step, final=False, stopped=state["stopped"], extra={"startup_s": state["startup_s"], **progress})

    def phase(name: str):
        progress.update(phase=name, phase_step=len(per_step) + 1, phase_started_s=time.perf_counter() - T_WORKER)
        write()
    n = s["prompts_per_step"] * s["samples_per_prompt"]

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args, state_, control, **kw):
            state["startup_s"] = time.perf_counter() - T_WORKER
            phase("step start")

        def on_step_begin(self, args, state_, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state_, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            st = {"step": state_.global_step, "step_s": time.perf_counter() - self.t0}
            if len(gen_times) == len(per_step) + 1:  # one generation batch per optimizer step
                st["gen_s"] = gen_times[-1]
            per_step.append(st)
            if s["warmup"] < state_.global_step < s["total_steps"] and _out_of_time(s, st["step_s"]):  # as polyrl's
                state["stopped"] = f"row budget: stopped after step {state_.global_step} of {s['total_steps']}"
                control.should_training_stop = True
            phase("step start")

        def on_log(self, args, state_, control, logs=None, **kw):
            if logs and "reward" in logs and per_step:
                per_step[-1]["reward"] = logs["reward"]
                per_step[-1]["completion_tokens"] = logs.get("completions/mean_length", float("nan")) * n
                write()

    tok = AutoTokenizer.from_pretrained(s["model_dir"], padding_side="left")
    cfg = GRPOConfig(**trl_config_kwargs(s, continuous_batching, cb_field))
    trainer = GRPOTrainer(model=s["model_dir"], reward_funcs=[arithmetic], args=cfg, train_dataset=dataset,
                          processing_class=tok, callbacks=[StepTimer()])
    inner = trainer._generate_and_score_completions

    def timed(*a, **k):  # generation + reward + (reference) log-probs of one generation batch
        phase("generation")
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = inner(*a, **k)
        if cuda:
            torch.cuda.synchronize()
        gen_times.append(time.perf_counter() - t)
        progress["last_gen_s"] = gen_times[-1]
        phase("train")
        return out

    trainer._generate_and_score_completions = timed
    trainer.train()
    import importlib.util
    return {"steps": per_step, "stopped": state["stopped"], "startup_s": state["startup_s"],
            "cb_field": cb_field, "trl_generation": "transformers continuous batching" if cb_field else "transformers generate",
            "attn_implementation": getattr(trainer.model.config, "_attn_implementation", None),
            "flash_attn_installed": importlib.util.find_spec("flash_attn") is not None,
            "kernels_installed": importlib.util.find_spec("kernels") is not None}


def worker_main(framework: str, spec_path: str) -> int:
    import logging
    import warnings
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    with open(spec_path) as f:
        s = json.load(f)
    print(f"worker {framework}: {s['warmup']} warm-up + {s['steps']} measured steps"
          + (f", budget {s['deadline_unix'] - time.time():.0f}s left" if s.get("deadline_unix") else ""), flush=True)
    try:
        res = run_polyrl(s) if framework == "polyrl" else run_trl(s, continuous_batching=framework == "trl-cb")
    except BaseException as e:
        import traceback
        traceback.print_exc()
        if os.path.isfile(s["result_path"]):  # keep the steps measured before the failure
            with open(s["result_path"]) as f:
                done = json.load(f)
            done["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:500]
            write_json(s["result_path"], done)
        raise
    steps = res.pop("steps")
    _write_progress(s, steps, final=True, stopped=res.pop("stopped", None), extra=res)
    return 0


# ---- parent: prepare, run each, report -----------------------------------------------------------------------
def summarize(framework: str, results: list[dict], s: dict, prompt_tokens: list[int]) -> dict:
    """One row from one or more runs of a framework: warm-up steps dropped from each run, the
    measured steps pooled; the reward is the mean of each run's last K steps. A run that stopped
    (budget, kill, error) before any measured step contributes its warm-up steps, and the row says so."""
    w, k = s["warmup"], s["reward_last_k"]
    measured, runs, warmup_used = [], [], False
    for res in results:
        steps = sorted(res["steps"], key=lambda r: r["step"])
        keep = steps[w:]
        if not keep and steps:
            keep, warmup_used = steps, True
        measured += keep
        runs.append({"per_step": steps, "steps_run": len(steps), "step_s_median": median([r["step_s"] for r in keep]),
                     "reward_last_k": sum(r.get("reward", float("nan")) for r in steps[-k:]) / max(len(steps[-k:]), 1),
                     **{key: res.get(key) for key in ("other_cpu_frac", "peak_rss_mib", "peak_gpu_mib", "peak_gpu_reserved_mib",
                                                      "gpu_total_mib", "gpu_name", "wall_s", "startup_s", "stopped",
                                                      "error", "final", "trl_generation", "cb_field", "attn_implementation",
                                                      "flash_attn_installed", "kernels_installed")}})
    step_s = [r["step_s"] for r in measured]
    gen_tok = [r.get("completion_tokens", float("nan")) for r in measured]
    trained = [t + prompt_tokens[(r["step"] - 1) % len(prompt_tokens)] for t, r in zip(gen_tok, measured)]
    gen_s = [r["gen_s"] for r in measured if r.get("gen_s") is not None]
    gen_tok_g = [r.get("completion_tokens", float("nan")) for r in measured if r.get("gen_s") is not None]
    others = [r["other_cpu_frac"] for r in runs if r["other_cpu_frac"] is not None]
    peak = lambda key: max((r[key] for r in runs if r.get(key) is not None), default=None)  # noqa: E731
    row = {
        "framework": framework, "runs": len(runs), "steps_run": sum(r["steps_run"] for r in runs),
        "steps_measured": len(measured), "warmup": w, "warmup_in_median": warmup_used,
        "step_s_median": median(step_s),
        "gen_s_median": median(gen_s),
        "gen_tokens_per_s": sum(gen_tok) / sum(step_s) if step_s else float("nan"),
        "gen_phase_tokens_per_s": sum(gen_tok_g) / sum(gen_s) if gen_s else float("nan"),
        "trained_tokens_per_s": sum(trained) / sum(step_s) if step_s else float("nan"),
        "completion_tokens_per_step": median(gen_tok),
        "reward_last_k": sum(r["reward_last_k"] for r in runs) / len(runs) if runs else float("nan"),
        "reward_k": min(k, min((r["steps_run"] for r in runs), default=0)),
        "peak_rss_mib": peak("peak_rss_mib"), "peak_gpu_mib": peak("peak_gpu_mib"),
        "peak_gpu_reserved_mib": peak("peak_gpu_reserved_mib"), "gpu_total_mib": peak("gpu_total_mib"),
        "startup_s": peak("startup_s"), "other_cpu_frac": max(others) if others else None,
    }
    for key in ("gpu_name", "trl_generation", "cb_field"):
        if any(r.get(key) for r in runs):
            row[key] = next(r[key] for r in runs if r.get(key))
    stops = [r["stopped"] for r in runs if r.get("stopped")] + [f"error: {r['error']}" for r in runs if r.get("error")]
    if stops:
        row["stopped"] = "; ".join(stops)
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
    headers = ["framework", "steps (warm-up + measured)", "step s (median)", "gen phase s", "gen-phase tok/s", "gen tok/s",
               "trained tok/s", mem_name, "reward (last K)", "other CPU load"]
    body = []
    ok = [r for r in rows if "step_s_median" in r]
    for r in rows:
        if r not in ok:
            body.append([r["framework"], "skipped" if "skipped" in r else "failed"] + [""] * (len(headers) - 2))
            continue
        counted = f"{r['steps_run']} ({r['steps_run'] - r['steps_measured']} + {r['steps_measured']})"
        if r.get("warmup_in_median"):
            counted = f"{r['steps_run']} (warm-up only)"
        body.append([r["framework"], counted, fmt(r["step_s_median"], "{:.3f}"), fmt(r["gen_s_median"], "{:.3f}"),
                     fmt(r.get("gen_phase_tokens_per_s"), "{:.0f}"), fmt(r["gen_tokens_per_s"], "{:.0f}"),
                     fmt(r["trained_tokens_per_s"], "{:.0f}"), fmt(r.get(mem_key), "{:.0f}"),
                     fmt(r["reward_last_k"], "{:.3f}") + (f" (K={r['reward_k']})" if r.get("reward_k") else ""),
                     fmt(r["other_cpu_frac"] * 100 if r.get("other_cpu_frac") is not None else None, "{:.0f}%")])
    pol = next((r for r in ok if r["framework"] == "polyrl"), None)
    for r in ok:
        if pol is None or r is pol:
            continue
        ratio = lambda key: (pol[key] / r[key]) if pol.get(key) and r.get(key) else float("nan")  # noqa: E731
        step_ratio = ratio("step_s_median")
        step_cell = fmt(step_ratio, "{:.2f}x") + (f" ({1 / step_ratio:.2f}x faster)" if 0 < step_ratio < 1 else "")
        body.append([f"polyrl / {r['framework']}", "", step_cell, fmt(ratio("gen_s_median"), "{:.2f}x"),
                     fmt(ratio("gen_phase_tokens_per_s"), "{:.2f}x"), fmt(ratio("gen_tokens_per_s"), "{:.2f}x"),
                     fmt(ratio("trained_tokens_per_s"), "{:.2f}x"), fmt(ratio(mem_key), "{:.2f}x"),
                     fmt(pol["reward_last_k"] - r["reward_last_k"], "{:+.3f}"), ""])
    table = markdown_table(headers, body)
    notes = []
    for r in rows:
        if "skipped" in r:
            notes.append(f"{r['framework']}: skipped: {r['skipped']}")
        if "error" in r:
            notes.append(f"{r['framework']}: failed: {r['error']}")
        if r.get("stopped"):
            notes.append(f"{r['framework']}: {r['stopped']}")
        if r.get("warmup_in_median"):
            notes.append(f"{r['framework']}: no step after the warm-up fitted its budget; its figures are warm-up steps")
        if device == "cuda" and r.get("peak_gpu_reserved_mib") is not None:
            notes.append(f"{r['framework']}: peak GPU allocated {r['peak_gpu_mib']:.0f} MiB, reserved "
                         f"{r['peak_gpu_reserved_mib']:.0f} MiB of {r.get('gpu_total_mib') or 0:.0f}; start-up (imports, "
                         f"model load, engine) {fmt(r.get('startup_s'), '{:.1f}')} s")
    if notes:
        table += "\n\n" + "\n".join(notes)
    print(table)
    return table


def _row_budget(a: argparse.Namespace, fw: str, t_start: float) -> tuple[float | None, str | None]:
    """(seconds this row's worker may take or None for no limit, why it cannot run)."""
    budget = a.budgets.get(fw, a.budgets.get("*", 0.0)) or None
    if a.deadline > 0:
        left = a.deadline - (time.perf_counter() - t_start) - a.kill_grace - 5.0  # 5 s: the parent's own wrap-up
        if left < 20.0:
            return None, f"--deadline {a.deadline:.0f}s: {max(left, 0):.0f}s left for this row, too little to start it"
        budget = min(budget, left) if budget else left
    return budget, None


_ACTIVE: dict = {}  # the running worker, killed with its process group if this script is terminated


def _on_terminate(signum, frame):
    proc = _ACTIVE.get("proc")
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    raise SystemExit(128 + signum)


def _run_worker(cmd: list[str], log_path: str, timeout: float | None) -> tuple[int | None, str | None]:
    """Runs a worker in its own process group with stdout/stderr to log_path. Returns (exit code,
    None) or (None, why) when it had to be killed at `timeout`."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _ACTIVE["proc"] = proc
        try:
            return proc.wait(timeout=timeout), None
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None, f"killed at its hard limit ({timeout:.0f}s: budget + --kill-grace)"
        finally:
            _ACTIVE.pop("proc", None)


def _tail(path: str, n: int = 30) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return f.read().strip().splitlines()[-n:]
    except OSError:
        return []


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    a = parse_args(argv)
    if a._worker:
        return worker_main(a._worker, a._spec)
    want_trl = any(f.startswith("trl") for f in a.framework_list)
    plan = {"device": a.device, "model_shape": a.model_shape, "prompts_per_step": a.prompts_per_step,
            "samples_per_prompt": a.samples_per_prompt, "max_new_tokens": a.max_new_tokens, "lr": a.lr, "beta": a.beta,
            "seed": a.seed, "micro_batch_size": a.micro_batch_size,
            "polyrl_default_batching": a.polyrl_default_batching, "warmup": a.warmup, "steps": a.steps,
            "total_steps": a.warmup + a.steps, "trl_warmup": a.trl_warmup, "trl_steps": a.trl_steps,
            "reward_last_k": a.reward_last_k, "frameworks": a.framework_list, "row_budget_s": a.budgets,
            "deadline_s": a.deadline, "kill_grace_s": a.kill_grace, "polyrl_args": a.polyrl_args, "precision": a.precision,
            "repeats": a.repeats, "wait_quiet": a.wait_quiet, "retry_busy": a.retry_busy, "digits": a.digits, "sft_warmstart_epochs": a.sft_warmstart_epochs,
            "model_dir": "<workdir>/model", "train_data": "<workdir>/data/train.jsonl", "run_dir": "<workdir>/<framework>"}
    if a.dry_run:
        trl_plan = framework_plan(plan, "trl")
        print(json.dumps({"plan": plan, "polyrl_argv": polyrl_argv(plan), "trl_grpo_config": trl_config_kwargs(trl_plan)}, indent=1))
        return 0
    import importlib.util
    if want_trl and importlib.util.find_spec("trl") is None:
        print(f"compare_trl: error: {INSTALL_HINT}", file=sys.stderr)
        return 2
    if a.device == "cuda":
        import torch
        if not torch.cuda.is_available():  # no CUDA context in this process: the workers own the GPU
            print("compare_trl: error: --device cuda but no CUDA device is visible", file=sys.stderr)
            return 2
    import platform
    import shutil
    signal.signal(signal.SIGTERM, _on_terminate)
    work = a.workdir or tempfile.mkdtemp(prefix="polyrl_compare_trl_")
    os.makedirs(work, exist_ok=True)
    out_dir = os.path.dirname(os.path.abspath(a.out)) if a.out else work
    stem = os.path.splitext(os.path.basename(a.out))[0] if a.out else "compare_trl"
    os.makedirs(out_dir, exist_ok=True)
    print(f"workdir: {work}" + (f"; worker logs and per-step files: {out_dir}/{stem}.<framework>_run<N>.*" if a.out else ""))
    try:
        import torch
        import transformers
        versions = {"torch": torch.__version__, "transformers": transformers.__version__}
        if want_trl:
            import importlib.metadata as md
            for pkg in ("trl", "datasets", "accelerate", "pyarrow", "fsspec", "huggingface-hub"):
                try:
                    versions[pkg] = md.version(pkg)
                except md.PackageNotFoundError:
                    versions[pkg] = None
    except ImportError:
        versions = {}
    prep = prepare(a, work)
    print(f"prepared in {time.perf_counter() - t_start:.1f}s", flush=True)
    ptoks = prompt_tokens_per_step(prep["model_dir"], prep["data"]["train"], a.prompts_per_step, a.samples_per_prompt,
                                   max(a.warmup + a.steps, a.trl_warmup + a.trl_steps))
    runnable, rows_by_fw = [], {}
    for fw in a.framework_list:
        why = None
        if fw == "trl-cb" and trl_cb_field()[0] is None:
            why = trl_cb_field()[1]
        if why:
            print(f"skip {fw}: {why}")
            rows_by_fw[fw] = {"framework": fw, "skipped": why}
        else:
            runnable.append(fw)
    results: dict[str, list[dict]] = {fw: [] for fw in runnable}
    specs: dict[str, dict] = {}
    out_doc = {"settings": plan, "model": prep["model_info"], "sft_seconds": prep["sft_seconds"], "versions": versions,
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
               "command": " ".join(["python bench/compare_trl.py", *(argv if argv is not None else sys.argv[1:])])}

    def save(final: bool) -> list[dict]:
        rows = []
        for fw in a.framework_list:
            if fw in rows_by_fw:
                rows.append(rows_by_fw[fw])
            elif results.get(fw):
                rows.append(summarize(fw, results[fw], specs[fw], ptoks))
        if a.out:
            write_json(a.out, {**out_doc, "rows": rows, "complete": final,
                               "elapsed_s": time.perf_counter() - t_start})
        return rows

    save(False)
    for rep in range(a.repeats):
        for fw in runnable:
            if fw in rows_by_fw:  # failed or skipped before
                continue
            tag = f"{stem}.{fw}_run{rep}"
            s = {**framework_plan(plan, fw), "model_dir": prep["model_dir"], "train_data": prep["data"]["train"],
                 "run_dir": os.path.join(work, f"{fw}_run{rep}"), "result_path": os.path.join(out_dir, f"{tag}.json")}
            specs[fw] = s
            spec = os.path.join(work, f"{fw}_spec{rep}.json")
            for attempt in range(4 if a.retry_busy > 0 else 1):
                if a.wait_quiet > 0:
                    share = wait_for_quiet(a.wait_quiet)
                    if share is not None and share >= 0.08:
                        print(f"    machine still {share:.0%} busy after --wait-quiet {a.wait_quiet:.0f}s; running anyway")
                budget, why = _row_budget(a, fw, t_start)
                if why:
                    if attempt:  # no time for a rerun: keep the busy run we have
                        print(f"    no rerun: {why}")
                        why = None
                    break
                s["deadline_unix"] = time.time() + budget if budget else None
                s["budget_s"] = budget
                write_json(spec, s)
                shutil.rmtree(s["run_dir"], ignore_errors=True)  # polyrl appends to metrics.jsonl
                if os.path.exists(s["result_path"]):
                    os.remove(s["result_path"])
                log_path = os.path.join(out_dir, f"{tag}.log")
                print(f"--- {fw} (run {rep + 1}/{a.repeats}{f', retry {attempt}' if attempt else ''}): "
                      f"{s['warmup']} warm-up + {s['steps']} measured steps"
                      + (f", budget {budget:.0f}s" if budget else "") + f", log {log_path} ...", flush=True)
                with ContentionProbe() as probe:
                    rc, killed = _run_worker([sys.executable, os.path.abspath(__file__), "--_worker", fw, "--_spec", spec],
                                             log_path, budget + a.kill_grace if budget else None)
                busy = probe.other_frac is not None and probe.other_frac > (a.retry_busy or 0.05)
                if busy:
                    print(f"    other processes used {probe.other_frac:.0%} of the CPUs during this run; its timings are inflated"
                          + ("; rerunning" if a.retry_busy > 0 and attempt < 3 and rc == 0 else ""))
                if rc != 0 or not (busy and a.retry_busy > 0):
                    break
            if why:
                print(f"skip {fw}: {why}")
                if not results[fw]:
                    rows_by_fw[fw] = {"framework": fw, "skipped": why}
                continue
            res = None
            if os.path.isfile(s["result_path"]):
                with open(s["result_path"]) as f:
                    res = json.load(f)
            if rc != 0 or not res or not res.get("steps"):
                err = _tail(log_path)
                print(f"{fw} {'was ' + killed if killed else f'failed (exit {rc})'}; last lines of {log_path}:\n    "
                      + "\n    ".join(err[-30:]), file=sys.stderr, flush=True)
                if not res or not res.get("steps"):
                    msg = killed or (err[-1] if err else f"exit {rc}")
                    if res and res.get("phase"):
                        msg += (f"; it was in step {res['phase_step']}'s {res['phase']} phase, begun "
                                f"{res['phase_started_s']:.0f}s after the worker started"
                                + (f" (start-up took {res['startup_s']:.0f}s)" if res.get("startup_s") else "")
                                + (f"; that step's generation phase took {res['last_gen_s']:.1f}s" if res.get("last_gen_s") else ""))
                    rows_by_fw[fw] = {"framework": fw, "error": msg, "log": log_path, "progress": res}
                    save(False)
                    continue
                res.setdefault("error", killed or (err[-1] if err else f"exit {rc}"))
            res["other_cpu_frac"] = probe.other_frac
            res["log"] = log_path
            results[fw].append(res)
            one = summarize(fw, [res], s, ptoks)
            load = f", other CPU load {probe.other_frac:.0%}" if probe.other_frac is not None else ""
            print(f"    done in {probe.wall:.1f}s: {one['steps_run']} steps, step {one['step_s_median']:.3f}s, "
                  f"reward(last {one['reward_k']}) {one['reward_last_k']:.3f}{load}"
                  + (f", stopped: {one['stopped']}" if one.get("stopped") else "")
                  + (f", polyrl parts {json.dumps({k: round(v, 3) for k, v in one['parts_median_s'].items()})}"
                     if "parts_median_s" in one else ""), flush=True)
            save(False)
    rows = save(True)
    print()
    table = print_table(rows, a.device)
    if a.out:
        out_doc["table"] = table
        write_json(a.out, {**out_doc, "rows": rows, "complete": True, "elapsed_s": time.perf_counter() - t_start})
        print(f"\nwrote {a.out} ({time.perf_counter() - t_start:.0f}s in all)")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
