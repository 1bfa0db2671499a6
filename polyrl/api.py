"""polyrl from Python: `polyrl.train(model=..., prompts=..., reward_funcs=[...], **fields)`.

The keywords are the config's fields (the flags' names with underscores: rollout_batch_size, n_samples_per_prompt,
lr, ...), plus the names TRL users know (TRL_NAMES). The call runs `polyrl train` in this process through the same
entry point as the command line, so validation, error lines, checkpoints and the run directory are the flags' own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import itertools
import json
import os
from collections.abc import Callable, Iterable
from typing import Any

# TRL's GRPOConfig name -> polyrl's field (its flag: the name with dashes)
TRL_NAMES = {
    "num_generations": "n_samples_per_prompt",
    "max_completion_length": "rollout_max_response_len",
    "max_prompt_length": "rollout_max_prompt_len",
    "learning_rate": "lr",
    "beta": "kl_loss_coef",
    "per_device_train_batch_size": "micro_batch_size",
    "temperature": "rollout_temperature",
    "epsilon": "eps_clip",
    "epsilon_high": "eps_clip_high",
    "max_steps": "num_rollout",
    "output_dir": "save",
    "logging_dir": "run_dir",
}
_REWARDS: dict[str, Callable] = {}  # the callables of running train() calls, reached by --custom-rm-path polyrl.api:NAME
_COUNTER = itertools.count()


def train(model: str, prompts: str | os.PathLike | Iterable, reward_funcs: Callable | list[Callable] | None = None, *,
          eval_prompts: str | os.PathLike | Iterable | None = None, **fields: Any) -> dict:
    """Run GRPO (or any --advantage-estimator) on `model` (an HF directory) and return {"run_dir", "metrics"} (the
    rows of RUN_DIR/metrics.jsonl). A bad setting raises ValueError with the error line the command would print.

    prompts / eval_prompts: a path (jsonl, parquet, or a `datasets` save_to_disk directory), a list of prompt strings,
    or rows {"prompt": ..., "label": ...} (a list, or a datasets.Dataset: anything that iterates dicts).
    reward_funcs: callables whose rewards add up per sample: polyrl's form `f(sample) -> float` (sample.response,
    sample.label, sample.prompt) or TRL's `f(prompts, completions, **kwargs) -> list[float]` (called with one sample:
    kwargs hold `label` and `completion_ids`). Without them, rm_type= names a built-in reward.
    fields: config fields by name (rollout_batch_size=8, lr=1e-5, apply_chat_template=True, ...) or TRL_NAMES."""
    from polyrl.cli import main

    fields = _translate(fields)
    run_dir = str(fields.setdefault("run_dir", "runs/latest"))
    os.makedirs(run_dir, exist_ok=True)
    fields["prompt_data"] = _data_path(prompts, run_dir, "prompts")
    if eval_prompts is not None:
        fields["eval_prompt_data"] = _data_path(eval_prompts, run_dir, "eval_prompts")
    name = None
    if reward_funcs is not None:
        if "custom_rm_path" in fields or "rm_type" in fields:
            raise ValueError("reward_funcs and rm_type / custom_rm_path both choose the reward: keep one")
        name = f"reward_{next(_COUNTER)}"
        _REWARDS[name] = combined_reward(reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs])
        fields["custom_rm_path"] = f"polyrl.api:{name}"
    argv = ["train", "--hf-checkpoint", str(model), *to_flags(fields)]
    from polyrl import cpu_env
    with cpu_env.in_this_process(["polyrl", *argv]):  # the CPU threads and their wait, as the command gets them
        try:
            code = main(argv)
        finally:
            if name is not None:
                _REWARDS.pop(name, None)
    if code != 0:
        raise ValueError(f"polyrl.train: polyrl train exited with status {code}; its error line is above")
    path = os.path.join(run_dir, "metrics.jsonl")
    rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    return {"run_dir": run_dir, "metrics": rows}


def __getattr__(name: str) -> Callable:
    """--custom-rm-path polyrl.api:reward_N resolves to the reward_funcs of the train() call that is running."""
    if name in _REWARDS:
        return _REWARDS[name]
    raise AttributeError(f"module 'polyrl.api' has no attribute {name!r}")


def combined_reward(funcs: list[Callable]) -> Callable:
    """One per-sample reward: the sum of `funcs`, each in polyrl's form or TRL's (see train)."""
    for f in funcs:
        if not callable(f):
            raise ValueError(f"reward_funcs: {f!r} is not callable")
    trl = [_takes_completions(f) for f in funcs]

    def reward(sample) -> float:
        total = 0.0
        for f, batch in zip(funcs, trl):
            if batch:
                out = f(prompts=[sample.prompt], completions=[sample.response], label=[sample.label],
                        completion_ids=[sample.response_ids])
                total += float(out[0])
            else:
                total += float(f(sample))
        return total
    return reward


def _takes_completions(f: Callable) -> bool:
    try:
        return "completions" in inspect.signature(f).parameters
    except (TypeError, ValueError):  # a builtin without a signature: polyrl's form
        return False


def _translate(fields: dict) -> dict:
    out = dict(fields)
    for trl, ours in TRL_NAMES.items():
        if trl in out:
            if ours in out:
                raise ValueError(f"{trl} is TRL's name for {ours}: give one of them")
            out[ours] = out.pop(trl)
            if trl == "beta" and out[ours]:
                out.setdefault("use_kl_loss", True)  # TRL's beta > 0 is a KL term in the loss
    return out


def _data_path(data, run_dir: str, what: str) -> str:
    """A path as given; rows (strings or dicts) written as jsonl to RUN_DIR/WHAT-HASH.jsonl, named by their content so
    that a call refused for a used run dir overwrites no earlier call's file."""
    if isinstance(data, (str, os.PathLike)):
        return os.fspath(data)
    rows = []
    for i, row in enumerate(data):
        if isinstance(row, str):
            row = {"prompt": row}
        if not isinstance(row, dict):
            raise ValueError(f"{what}[{i}] is a {type(row).__name__}: give prompt strings or rows like "
                             "{'prompt': ..., 'label': ...}")
        rows.append(row)
    if not rows:
        raise ValueError(f"{what} is empty")
    text = "".join(json.dumps(r, default=str) + "\n" for r in rows)
    path = os.path.join(run_dir, f"{what}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.jsonl")
    with open(path, "w") as f:
        f.write(text)
    return path


def to_flags(fields: dict) -> list[str]:
    """Config fields by name -> the command line that sets them (booleans as --x / --no-x, lists as several values)."""
    from polyrl.config import Config, _flag
    flags = {f.name: _flag(f) for sec in dataclasses.fields(Config) for f in dataclasses.fields(sec.default_factory)}
    argv: list[str] = []
    for key, value in fields.items():
        if key not in flags:
            raise ValueError(f"polyrl.train: unknown setting {key!r} (the fields are the flags' names with underscores; "
                             f"TRL names known: {', '.join(TRL_NAMES)})")
        flag = flags[key]
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv
