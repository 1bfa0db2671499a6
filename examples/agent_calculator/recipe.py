"""Does RL teach an agent to use its tool? A tiny model, SFT on a mix where most problems are answered directly (it
cannot multiply, so those answers are wrong) and a few go through the calculator, then GRPO of the `openai` SDK agent
in agent.py through polyrl's OpenAI-compatible gateway (--agent-function-path). Held-out accuracy (greedy, problems
seen in neither SFT nor RL) and tool use (`eval/turns`: 2 when the agent called the calculator) before and after GRPO.
Writes RUN_DIR/summary.json.

    python examples/agent_calculator/recipe.py            # from the repository root; a few minutes on 2 CPU cores
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
CONFIG = os.path.join(HERE, "config.yaml")
FUNCTIONS = ["--agent-function-path", f"{os.path.join(HERE, 'agent.py')}:agent",
             "--custom-rm-path", f"{os.path.join(HERE, 'agent.py')}:reward"]

# one token each: the tool-call tags and the JSON around a calculator call's expression (so a call is a dozen tokens,
# not sixty characters); the text they spell is Qwen's <tool_call> format, which the gateway parses
CALL_HEAD, CALL_TAIL = '{"name": "calculator", "arguments": {"expression": "', '"}}'
TOKENS = ("*", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", CALL_HEAD, CALL_TAIL)
# each message's content as it is (examples/tool_calculator's template), an assistant turn closed by <eos>, its tool
# calls as Qwen's templates write them (tojson of name and arguments), a tool result in <tool_response> tags
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>{% else %}{{ m.content or '' }}{% endif %}"
    "{% if m.role == 'assistant' %}{% for c in m.tool_calls or [] %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}<eos>{% endif %}"
    "{% endfor %}")


def build_base_model(path: str, *, hidden: int, layers: int, seed: int) -> None:
    from tokenizers import decoders

    from polyrl.tasks.arithmetic import build_model, build_tokenizer
    tok = build_tokenizer(extra_tokens=TOKENS, chat_template=CHAT_TEMPLATE)
    tok.backend_tokenizer.decoder = decoders.Fuse()  # text joins without spaces, so the call's JSON reads back as sent
    build_model(path, hidden=hidden, layers=layers, seed=seed, arch="llama", tokenizer=tok)


def write_data(out_dir: str, *, digits: int, n_train: int, n_eval: int, tool_share: float, seed: int) -> dict[str, str]:
    """sft.jsonl (conversations: a `tool_share` of them call the calculator, the others answer directly), train.jsonl
    and eval.jsonl (prompt/label). Eval problems are in no train file."""
    low, rng, seen, rows = math.isqrt(10 ** (2 * digits - 1) - 1) + 1, random.Random(seed), set(), []
    while len(rows) < n_train + n_eval:
        a, b = (rng.randrange(low, 10**digits) for _ in range(2))
        if (a, b) not in seen:
            seen.add((a, b))
            rows.append((f"{a}*{b}=", str(a * b), f"{a}*{b}"))
    evals, train = rows[:n_eval], rows[n_eval:]
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, f"{k}.jsonl") for k in ("sft", "train", "eval")}
    with open(paths["sft"], "w") as f:
        for p, y, e in train:
            turns = [{"role": "user", "content": p}]
            if rng.random() < tool_share:
                turns += [{"role": "assistant", "content": f"<tool_call>{CALL_HEAD}{e}{CALL_TAIL}</tool_call>"},
                          {"role": "tool", "content": y}]
            f.write(json.dumps({"prompt": turns + [{"role": "assistant", "content": y}]}) + "\n")
    for key, part in (("train", train), ("eval", evals)):
        with open(paths[key], "w") as f:
            f.writelines(json.dumps({"prompt": p, "label": y}) + "\n" for p, y, _ in part)
    return paths


def polyrl(*args: str) -> None:
    from polyrl.cli import main as polyrl_main
    print("$ polyrl " + " ".join(args), flush=True)
    if polyrl_main(list(args)) != 0:
        raise SystemExit(f"polyrl {args[0]} failed")


def evaluated(run_dir: str) -> dict:
    e = json.load(open(os.path.join(run_dir, "eval.json")))
    return {"accuracy": e["eval/accuracy"], "turns": e["eval/turns"]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", default="runs/agent_calculator")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--digits", type=int, default=3, help="digits of each factor")
    p.add_argument("--n-train", type=int, default=4000)
    p.add_argument("--n-eval", type=int, default=200)
    p.add_argument("--tool-share", type=float, default=0.3, help="share of SFT conversations that call the calculator")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--sft-epochs", type=int, default=4)
    p.add_argument("--grpo-steps", type=int, default=30)
    p.add_argument("--rollout-batch-size", type=int, default=8)
    p.add_argument("--n-samples-per-prompt", type=int, default=8)
    a = p.parse_args(argv)
    t0, run = time.perf_counter(), a.run_dir
    shutil.rmtree(run, ignore_errors=True)
    data = write_data(os.path.join(run, "data"), digits=a.digits, n_train=a.n_train, n_eval=a.n_eval,
                      tool_share=a.tool_share, seed=a.seed)
    base, sft_model, rl_model = (os.path.join(run, d) for d in ("base_model", "sft_model", "grpo_model"))
    build_base_model(base, hidden=a.hidden, layers=a.layers, seed=a.seed)
    common = ["--seed", str(a.seed), "--quiet", "--device", "cpu"]
    evals = ["--eval-prompt-data", data["eval"], "--apply-chat-template", *FUNCTIONS, "--max-turns", "3",
             "--rollout-max-response-len", "48", "--rollout-max-context-len", "64"]
    polyrl("sft", "--hf-checkpoint", base, "--prompt-data", data["sft"], "--apply-chat-template",
           "--global-batch-size", "32", "--micro-batch-size", "32", "--num-epoch", str(a.sft_epochs), "--lr", "1e-2",
           "--lr-warmup-steps", "10", "--lr-decay-style", "cosine", "--min-lr", "1e-3", "--adam-beta2", "0.98",
           "--weight-decay", "0.0", "--save-hf", sft_model, "--run-dir", os.path.join(run, "sft"), *common)
    polyrl("eval", "--hf-checkpoint", sft_model, *evals, "--run-dir", os.path.join(run, "eval_sft"), *common[:2], *common[3:])
    polyrl("train", "--config", CONFIG, "--hf-checkpoint", sft_model, "--prompt-data", data["train"], *FUNCTIONS,
           "--num-rollout", str(a.grpo_steps), "--rollout-batch-size", str(a.rollout_batch_size),
           "--n-samples-per-prompt", str(a.n_samples_per_prompt), "--eval-prompt-data", "", "--eval-interval", "0",
           "--save-hf", rl_model, "--run-dir", os.path.join(run, "grpo"), *common)
    polyrl("eval", "--hf-checkpoint", rl_model, *evals, "--run-dir", os.path.join(run, "eval_grpo"), *common[:2], *common[3:])
    steps = [json.loads(line) for line in open(os.path.join(run, "grpo", "metrics.jsonl"))]
    summary = {"sft": evaluated(os.path.join(run, "eval_sft")), "grpo": evaluated(os.path.join(run, "eval_grpo")),
               "reward_by_step": [round(m["reward/mean"], 3) for m in steps],
               "agent_calls_by_step": [round(m["agent/calls"], 2) for m in steps],
               "failed_agents": sum(m["agent/failed"] for m in steps),
               "split_trajectories": sum(m["agent/split_trajectories"] for m in steps),
               "seed": a.seed, "n_eval": a.n_eval, "grpo_steps": a.grpo_steps, "tool_share": a.tool_share,
               "wall_seconds": round(time.perf_counter() - t0, 1)}
    with open(os.path.join(run, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"held-out accuracy ({a.n_eval} unseen {a.digits}x{a.digits}-digit products, greedy) and chat calls per problem")
    for k in ("sft", "grpo"):
        print(f"  after {k.upper():<5} accuracy {summary[k]['accuracy']:.3f}   calls {summary[k]['turns']:.2f}")
    print(f"summary: {json.dumps(summary)}")
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
