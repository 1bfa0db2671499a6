"""DAPO dynamic sampling (--dynamic-sampling-filter-path, --over-sampling-batch-size) and overlong reward shaping
through the CLI on a tiny model, on CPU: every step trains exactly --rollout-batch-size groups that passed the filter,
the metrics count what was dropped, and a filter that never passes stops the run with a message naming the flags."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from polyrl.cli import main
from polyrl.rewards import merge_reward_metrics
from polyrl.rewards.filters import nonzero_std
from polyrl.rollout.dynamic_sampling import GroupFilter
from polyrl.step.learner import Learner
from polyrl.types import Sample

# groups of even-labelled prompts all get 1.0 (zero std: nonzero_std drops them), the others 0, 1, 0, 1
GROUP_RM = '''
import json, os
def group(samples):
    even = int(samples[0].label) % 2 == 0
    rewards = [1.0] * len(samples) if even else [float(i % 2) for i in range(len(samples))]
    with open(os.environ["POLYRL_TEST_GROUPS"], "a") as f:
        f.write(json.dumps([samples[0].prompt, rewards, os.environ.get("RANK")]) + "\\n")
    return rewards
def constant(samples):
    return [0.5] * len(samples)
'''
FILTER = "polyrl.rewards.filters:nonzero_std"


def sample(reward: float) -> Sample:
    return Sample(prompt_ids=[1], response_ids=[2], rollout_logprobs=[0.0], finish_reason="stop", reward=reward)


def test_nonzero_std_keeps_groups_with_different_rewards():
    assert nonzero_std([sample(0.0), sample(1.0), sample(0.0)])
    assert not nonzero_std([sample(0.5), sample(0.5)])
    assert not nonzero_std([sample(1.0)])  # one sample: no spread, no GRPO signal


def test_reward_metrics_of_several_draws_are_weighted():
    m = merge_reward_metrics([(4, {"reward/mean": 1.0, "reward/errors": 1.0}),
                               (12, {"reward/mean": 0.0, "reward/errors": 2.0})])
    assert m == {"reward/mean": 0.25, "reward/errors": 3.0}


def test_a_filter_must_return_a_bool_and_its_errors_name_the_flag():
    from types import SimpleNamespace
    group = [sample(0.0), sample(1.0)]
    for fn, exc, needle in [(lambda g: 1, TypeError, "returned 1 (int); return True"),
                            (lambda g: 1 / 0, RuntimeError, "raised on a group of 2 samples")]:
        sampler = SimpleNamespace(keep_group=fn, path="m:f")
        with pytest.raises(exc, match=re.escape(needle)):
            GroupFilter.__call__(sampler, group)


@pytest.fixture
def args(tiny_model, arith_data, tmp_path, monkeypatch):
    rm = tmp_path / "rm.py"
    rm.write_text(GROUP_RM)
    monkeypatch.setenv("POLYRL_TEST_GROUPS", str(tmp_path / "groups.jsonl"))
    return ["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--group-rm",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "4", "--lr", "1e-3",
            "--quiet", "--seed", "3", "--device", "cpu", "--run-dir", str(tmp_path / "run")]


def trained_steps(monkeypatch) -> list[list[Sample]]:
    """The samples each step trains on, recorded from the learner."""
    seen, update = [], Learner.update

    def record(self, samples, *a, **k):
        seen.append(list(samples))
        return update(self, samples, *a, **k)
    monkeypatch.setattr(Learner, "update", record)
    return seen


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_dynamic_sampling_trains_exactly_rollout_batch_size_groups(args, tmp_path, monkeypatch, mode):
    rm = tmp_path / "rm.py"
    steps = trained_steps(monkeypatch)
    extra = ["--async"] if mode == "async" else []
    assert main([*args, "--custom-rm-path", f"{rm}:group", "--dynamic-sampling-filter-path", FILTER,
                 "--over-sampling-batch-size", "6", "--num-rollout", "3", *extra]) == 0
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    groups = [json.loads(line) for line in open(tmp_path / "groups.jsonl")]
    assert len(steps) == len(rows) == 3
    for trained in steps:  # 4 prompts x 4 samples, none from an all-equal group
        assert len(trained) == 16
        for g in range(4):
            assert [s.group_index for s in trained[4 * g:4 * g + 4]] == [g] * 4
            assert len({s.reward for s in trained[4 * g:4 * g + 4]}) == 2
    for r in rows:
        assert r["dynamic_sampling/kept_groups"] == 4
        assert r["skipped_step"] == 0 and r["grad_norm"] > 0
    draws = sum(1 + r["dynamic_sampling/extra_draws"] for r in rows)
    assert len(groups) == 6 * draws  # every draw generated and scored its 6 prompts (one rank: never full before)
    assert any(r["dynamic_sampling/extra_draws"] >= 1 for r in rows)  # the data of this seed needs a second draw once
    dropped = sum(len(set(rewards)) == 1 for _, rewards, _ in groups)
    assert dropped == sum(r["dynamic_sampling/dropped_groups"] for r in rows) > 0
    assert len(groups) - dropped == sum(4 + r["dynamic_sampling/surplus_groups"] for r in rows)


@pytest.mark.slow
def test_two_ranks_each_fill_their_share_and_draw_alike(args, tmp_path):
    # each rank keeps --rollout-batch-size / 2 groups; a rank that is full draws (without generating) until the
    # other is full too, so both stay at the same data position; a disagreement would hang the run (timeout)
    from ranks import run_ranks
    argv = ["-m", "polyrl", *args, "--custom-rm-path", f"{tmp_path / 'rm.py'}:group", "--dynamic-sampling-filter-path",
            FILTER, "--over-sampling-batch-size", "6", "--num-rollout", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = run_ranks(argv, 2, env, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    groups = [json.loads(line) for line in open(tmp_path / "groups.jsonl")]
    assert [r["dynamic_sampling/kept_groups"] for r in rows] == [4, 4, 4]
    assert {rank for *_, rank in groups} == {"0", "1"}
    assert len({prompt for prompt, *_ in groups}) == len(groups)  # the ranks never score the same prompt
    dropped = sum(len(set(rewards)) == 1 for _, rewards, _ in groups)
    assert dropped == sum(r["dynamic_sampling/dropped_groups"] for r in rows)
    assert len(groups) - dropped == sum(4 + r["dynamic_sampling/surplus_groups"] for r in rows)


def test_filter_that_never_passes_stops_with_the_flags_named(args, tmp_path, capsys):
    rm = tmp_path / "rm.py"
    assert main([*args, "--custom-rm-path", f"{rm}:constant", "--dynamic-sampling-filter-path", FILTER,
                 "--max-dynamic-sampling-draws", "2", "--num-rollout", "2"]) == 2
    err = capsys.readouterr().err
    assert "dynamic sampling kept 0 of --rollout-batch-size 4 groups in step 1 after --max-dynamic-sampling-draws 2" in err
    assert "--over-sampling-batch-size" in err and "dropped 8 groups" in err and "Traceback" not in err


def test_custom_filter_file_and_overlong_penalty(args, tmp_path, monkeypatch):
    # a file filter keeping every group: nothing is dropped, one draw per step; the overlong penalty of
    # -(len - 2) / 2 for responses past 2 of 4 tokens lowers the rewards the step trains on
    rm = tmp_path / "rm.py"
    (tmp_path / "keep.py").write_text("def everything(samples):\n    return len(samples) == 4\n")
    steps = trained_steps(monkeypatch)
    assert main([*args, "--custom-rm-path", f"{rm}:constant", "--dynamic-sampling-filter-path", f"{tmp_path}/keep.py:everything",
                 "--overlong-buffer-len", "2", "--overlong-penalty-factor", "0.5", "--num-rollout", "1"]) == 0
    (row,) = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert (row["dynamic_sampling/dropped_groups"], row["dynamic_sampling/extra_draws"], row["reward/mean"]) == (0, 0, 0.5)
    expect = [0.5 - 0.5 * max(len(s.response_ids) - 2, 0) / 2 for s in steps[0]]
    assert [s.reward for s in steps[0]] == pytest.approx(expect)
    assert row["reward/overlong_penalty"] == pytest.approx(sum(e - 0.5 for e in expect) / 16)
    assert row["reward/overlong_penalty"] < 0  # an untrained model runs to the length limit at times


def test_cispo_trains_two_steps(args, tmp_path):
    rm = tmp_path / "rm.py"
    assert main([*args, "--custom-rm-path", f"{rm}:group", "--policy-loss", "cispo", "--eps-clip-high", "0.28",
                 "--global-batch-size", "8", "--num-rollout", "2"]) == 0
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert len(rows) == 2
    assert all(r["skipped_step"] == 0 and r["grad_norm"] > 0 for r in rows)
    assert rows[0]["ratio"] != 1.0  # the second minibatch of each step is off-policy


@pytest.mark.parametrize("argv, needle", [
    (["--over-sampling-batch-size", "8"], "--over-sampling-batch-size draws extra prompts for dynamic sampling"),
    (["--dynamic-sampling-filter-path", FILTER, "--over-sampling-batch-size", "2"],
     "--over-sampling-batch-size (2) must be >= --rollout-batch-size (4)"),
    (["--dynamic-sampling-filter-path", "nosuchmod:fn"], "--dynamic-sampling-filter-path 'nosuchmod:fn': could not import"),
    (["--dynamic-sampling-filter-path", "polyrl.rewards.filters:nope"], "has no function 'nope'"),
    (["--max-dynamic-sampling-draws", "0"], "--max-dynamic-sampling-draws must be >= 1"),
    (["--overlong-buffer-len", "5"], "--overlong-buffer-len (5) must be <= --rollout-max-response-len (4)"),
    (["--overlong-penalty-factor", "-1"], "--overlong-penalty-factor must be >= 0"),
    (["--policy-loss", "cispo", "--advantage-estimator", "gspo"], "--advantage-estimator gspo"),
    (["--policy-loss", "cispo", "--eps-clip-c", "3"], "--eps-clip-c (dual clip)"),
])
def test_invalid_values_exit_2_before_anything_starts(args, argv, needle, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("polyrl.assemble.setup_command", lambda cfg: pytest.fail("validation must stop the run before set-up"))
    assert main([*args, "--custom-rm-path", f"{tmp_path / 'rm.py'}:group", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
