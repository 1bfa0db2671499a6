"""--partial-rollout learns the demo task as the synchronous rollout does: `make demo`'s arithmetic setup (the
shortened demo's SFT, polyrl/demo.py's train_args), 10 GRPO steps with and without --partial-rollout (48 prompts in
flight for the step's 32 groups), in process on CPU."""

from __future__ import annotations

import json

from conftest import DEMO_SEED
from polyrl.cli import main
from polyrl.demo import train_args

STEPS = 10


def _accuracy(demo_sft, run, *extra) -> tuple[dict, list]:
    assert main(train_args(demo_sft["sft"], demo_sft["paths"], str(run), steps=STEPS, seed=DEMO_SEED,
                           eval_interval=STEPS) + ["--device", "cpu", *extra]) == 0
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    return {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}, rows


def test_partial_rollout_raises_held_out_accuracy_as_the_synchronous_rollout_does(demo_sft, tmp_path):
    """Greedy accuracy on the 200 held-out additions after the 10th step, with and without partial rollout. Margins:
    each run rises by >= 0.10 from the same start, and the two end within 0.10 of each other (20 problems); the evals
    are greedy over the same problems, so what varies is the policy (partial rollout trains on other samples: surplus
    groups a step late, cut ones continued under newer weights)."""
    plain, _ = _accuracy(demo_sft, tmp_path / "plain")
    partial, rows = _accuracy(demo_sft, tmp_path / "partial", "--partial-rollout", "--over-sampling-batch-size", "48")
    assert plain[0] == partial[0]
    assert plain[STEPS] - plain[0] >= 0.10 and partial[STEPS] - partial[0] >= 0.10, (plain, partial)
    assert abs(plain[STEPS] - partial[STEPS]) <= 0.10, (plain, partial)
    trained = [r for r in rows if "partial_rollout/resumed_samples" in r]
    assert len(trained) == STEPS
    assert sum(r["partial_rollout/aborted_samples"] for r in trained) > 0  # the tail was cut and continued
    # the engine against the trainer on the tokens of this policy: exact on CPU whatever was resumed
    assert all(r["train_rollout_logprob_abs_diff_max"] < 1e-4 for r in trained)
