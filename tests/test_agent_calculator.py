"""examples/agent_calculator end to end, shortened: SFT, the `openai` SDK agent evaluated and trained through the
gateway (one GRPO step), and its summary. The learning run with its numbers is in the example's README."""

from __future__ import annotations

import json
import os
import sys

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "agent_calculator")


def test_the_recipe_runs_its_agent_through_sft_grpo_and_eval(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLE)
    import recipe
    sys.modules.pop("recipe", None)
    s = recipe.main(["--run-dir", str(tmp_path / "run"), "--n-train", "160", "--n-eval", "8", "--grpo-steps", "1",
                     "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--sft-epochs", "1"])
    assert s["failed_agents"] == 0 and len(s["reward_by_step"]) == 1 and s["agent_calls_by_step"][0] >= 1
    for k in ("sft", "grpo"):
        assert 0.0 <= s[k]["accuracy"] <= 1.0 and 1.0 <= s[k]["turns"] <= 3.0
    assert json.load(open(tmp_path / "run" / "summary.json")) == s
    assert os.path.isfile(tmp_path / "run" / "grpo_model" / "config.json")


def test_the_agent_turns_calls_into_calculator_results():
    sys.path.insert(0, EXAMPLE)
    try:
        import agent
    finally:
        sys.path.remove(EXAMPLE)
    assert agent.calculator("481*773") == str(481 * 773) and agent.calculator("12 + 30") == "42"
    assert agent.calculator("rm -rf /").startswith("error")
