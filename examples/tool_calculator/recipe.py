"""Does the calculator make the model more accurate? Two arms from one random tiny model, equal budgets:

- tool:   `polyrl sft` on tool-use traces (prompt -> `<tool_call>A*B</tool_call>` -> tool turn -> answer; loss on the
          assistant turns only), then GRPO with calculator.py:generate (tool tokens loss-masked), --max-turns 2;
- direct: `polyrl sft` on the same problems answered directly, then GRPO with the same function, --max-turns 1
          (no tool).
Held-out accuracy (greedy, problems seen in neither SFT nor RL) after SFT and after GRPO for both, and the tool
arm's final model with its tool taken away (--max-turns 1). Writes RUN_DIR/summary.json, and each GRPO step's
scored rollouts (tokens, loss masks, tool results, rewards) to RUN_DIR/ARM/rollouts/step_N.jsonl.

    python examples/tool_calculator/recipe.py            # from the repository root; about 10 minutes on 2 busy CPU cores
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # calculator.py, next to this file

from calculator import CHAT_TEMPLATE, TOOL_TOKENS  # noqa: E402

from polyrl.cli import main as polyrl_main  # noqa: E402
from polyrl.tasks.arithmetic import build_model, build_tokenizer  # noqa: E402

CONFIG = os.path.join(HERE, "config.yaml")
FUNCTIONS = ["--custom-generate-function-path", f"{os.path.join(HERE, 'calculator.py')}:generate",
             "--custom-rm-path", f"{os.path.join(HERE, 'calculator.py')}:reward"]


def write_data(out_dir: str, *, digits: int, n_train: int, n_eval: int, seed: int) -> dict[str, str]:
    """sft_tool.jsonl and sft_direct.jsonl (conversations over the same train problems: with a calculator call, and
    answered directly), train.jsonl and eval.jsonl (prompt/label). Eval problems are in no train file."""
    # factors from sqrt(10^(2d-1)) up: every product has 2d digits, so each answer digit sits at a fixed distance
    # from its copy in the tool's response (a tiny model learns to copy by position in a few dozen steps)
    low, rng, seen, rows = math.isqrt(10 ** (2 * digits - 1) - 1) + 1, random.Random(seed), set(), []
    while len(rows) < n_train + n_eval:
        a, b = (rng.randrange(low, 10**digits) for _ in range(2))
        if (a, b) not in seen:
            seen.add((a, b))
            rows.append((f"{a}*{b}=", str(a * b), f"{a}*{b}"))
    evals, train = rows[:n_eval], rows[n_eval:]
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, f"{k}.jsonl") for k in ("sft_tool", "sft_direct", "train", "eval")}
    conversations = {
        "sft_tool": lambda p, y, e: [{"role": "user", "content": p},
                                     {"role": "assistant", "content": f"<tool_call>{e}</tool_call>"},
                                     {"role": "tool", "content": y}, {"role": "assistant", "content": y}],
        "sft_direct": lambda p, y, e: [{"role": "user", "content": p}, {"role": "assistant", "content": y}]}
    for key, turns in conversations.items():
        with open(paths[key], "w") as f:
            f.writelines(json.dumps({"prompt": turns(*r)}) + "\n" for r in train)
    for key, part in (("train", train), ("eval", evals)):
        with open(paths[key], "w") as f:
            f.writelines(json.dumps({"prompt": p, "label": y}) + "\n" for p, y, _ in part)
    return paths


def polyrl(*args: str) -> None:
    print("$ polyrl " + " ".join(args), flush=True)
    if polyrl_main(list(args)) != 0:
        raise SystemExit(f"polyrl {args[0]} failed")


def accuracy(run_dir: str) -> float:
    return json.load(open(os.path.join(run_dir, "eval.json")))["eval/accuracy"]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", default="runs/tool_calculator")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--digits", type=int, default=3, help="digits of each factor")
    p.add_argument("--n-train", type=int, default=2000)
    p.add_argument("--n-eval", type=int, default=200)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--sft-epochs", type=int, default=2)
    p.add_argument("--grpo-steps", type=int, default=20)
    p.add_argument("--rollout-batch-size", type=int, default=8)
    p.add_argument("--n-samples-per-prompt", type=int, default=8)
    a = p.parse_args(argv)
    t0, run = time.perf_counter(), a.run_dir
    shutil.rmtree(run, ignore_errors=True)
    data = write_data(os.path.join(run, "data"), digits=a.digits, n_train=a.n_train, n_eval=a.n_eval, seed=a.seed)
    base = os.path.join(run, "base_model")
    build_model(base, hidden=a.hidden, layers=a.layers, seed=a.seed,
                tokenizer=build_tokenizer(extra_tokens=TOOL_TOKENS, chat_template=CHAT_TEMPLATE))
    common = ["--seed", str(a.seed), "--quiet", "--device", "cpu"]
    evals = ["--eval-prompt-data", data["eval"], "--apply-chat-template", *FUNCTIONS, "--rollout-max-response-len", "32"]
    acc = {}
    for arm, turns in (("tool", "2"), ("direct", "1")):
        d = os.path.join(run, arm)
        sft_model, rl_model = os.path.join(d, "sft_model"), os.path.join(d, "grpo_model")
        polyrl("sft", "--hf-checkpoint", base, "--prompt-data", data[f"sft_{arm}"], "--apply-chat-template",
               "--global-batch-size", "32", "--micro-batch-size", "32", "--num-epoch", str(a.sft_epochs), "--lr", "1e-2",
               "--lr-warmup-steps", "10", "--lr-decay-style", "cosine", "--min-lr", "1e-3", "--adam-beta2", "0.98",
               "--weight-decay", "0.0", "--save-hf", sft_model, "--run-dir", os.path.join(d, "sft"), *common)
        polyrl("eval", "--hf-checkpoint", sft_model, *evals, "--max-turns", turns, "--run-dir", os.path.join(d, "eval_sft"),
               *common)
        polyrl("train", "--config", CONFIG, "--hf-checkpoint", sft_model, "--prompt-data", data["train"],
               *FUNCTIONS, "--max-turns", turns, "--num-rollout", str(a.grpo_steps),
               "--rollout-batch-size", str(a.rollout_batch_size), "--n-samples-per-prompt", str(a.n_samples_per_prompt),
               "--eval-prompt-data", "", "--eval-interval", "0", "--save-hf", rl_model,  # evals run as polyrl eval below
               "--save-debug-rollout-data", os.path.join(d, "rollouts", "step_{rollout_id}.jsonl"),
               "--run-dir", d, *common)
        polyrl("eval", "--hf-checkpoint", rl_model, *evals, "--max-turns", turns, "--run-dir", os.path.join(d, "eval_grpo"),
               *common)
        acc[arm] = {"sft": accuracy(os.path.join(d, "eval_sft")), "grpo": accuracy(os.path.join(d, "eval_grpo"))}
    no_tool = os.path.join(run, "tool", "eval_grpo_without_tool")
    polyrl("eval", "--hf-checkpoint", os.path.join(run, "tool", "grpo_model"), *evals, "--max-turns", "1",
           "--run-dir", no_tool, *common)
    acc["tool"]["grpo_without_tool"] = accuracy(no_tool)
    summary = {"accuracy": acc, "digits": a.digits, "sft_epochs": a.sft_epochs, "grpo_steps": a.grpo_steps,
               "seed": a.seed, "n_eval": a.n_eval, "wall_seconds": round(time.perf_counter() - t0, 1)}
    with open(os.path.join(run, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"held-out accuracy ({a.n_eval} unseen {a.digits}x{a.digits}-digit products, greedy)")
    print(f"  {'arm':<40}{'after SFT':>10}{'after GRPO':>12}")
    print(f"  {'tool (SFT on traces, GRPO with tool)':<40}{acc['tool']['sft']:>10.3f}{acc['tool']['grpo']:>12.3f}")
    print(f"  {'direct (SFT on answers, GRPO no tool)':<40}{acc['direct']['sft']:>10.3f}{acc['direct']['grpo']:>12.3f}")
    print(f"  {'tool arm, tool taken away':<40}{'':>10}{acc['tool']['grpo_without_tool']:>12.3f}")
    print(f"summary: {json.dumps(summary)}")
    return summary


if __name__ == "__main__":
    main()
