"""`make demo` end to end at a tiny budget: the commands chain and summary.json has its fields."""

from __future__ import annotations

import json
import os

from polyrl.demo import main


def test_demo_pipeline_writes_summary_and_plot(tmp_path):
    run = tmp_path / "demo"
    assert main(["--run-dir", str(run), "--sft-epochs", "1", "--grpo-steps", "1"]) == 0
    s = json.load(open(run / "summary.json"))
    assert {"eval_accuracy_before", "eval_accuracy_after", "steps", "wall_seconds"} <= s.keys()
    assert s["steps"] == 1 and 0.0 <= s["eval_accuracy_before"] <= 1.0
    assert os.path.getsize(run / "curves.png") > 10_000
    assert os.path.isfile(run / "grpo_model" / "config.json")
