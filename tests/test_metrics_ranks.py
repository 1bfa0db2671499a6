"""A step's rank-dependent metrics are over the whole step: 2 FSDP ranks (torchrun, CPU gloo) log the reward, response
length and eval metrics of a 1-rank run of the same seeds, and the reductions behind them hold for uneven ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from polyrl.dist import Dist
from polyrl.metrics import combine_rank_stats
from polyrl.step.learner import reduce_reward_metrics

# reward/errors on every sample whose token ids sum to 0 mod 7, partial credit on the others: rewards vary within a
# prompt's group and the error counts are not 0
REWARD = '''
def varied(sample):
    v = sum(sample.response_ids) % 7
    if v == 0:
        raise ValueError("no reward for this response")
    return v / 6.0
'''
# The engine seeds each (step, rank, prompt) apart, so 1 and 2 ranks sample different responses; a seed from the
# prompt and the sample's index alone makes the responses of a prompt the same whichever rank draws it.
GENERATE = '''
import dataclasses, zlib
async def generate(record, sp, engine, tokenizer):
    seed = zlib.crc32(str(record.prompt).encode()) * 16 + record.sample_index
    (s,) = await engine.generate(record.prompt_ids, dataclasses.replace(sp, seed=seed))
    return s
'''
STEPS = 2
# integer sums over the ranks: equal in any order
COUNTS = ("reward/samples", "reward/errors", "reward/timeouts", "reward/zeros", "eval/n", "eval/reward_errors",
          "eval/reward_timeouts")
# ratios of such sums (or means of exact multiples of 1/6, re-weighted by the ranks' sample counts): within a few ulps
MEANS = ("reward/mean", "reward/accuracy", "response_len/mean", "truncated_frac", "eval/accuracy", "eval/response_len")


def run(tmp_path, name: str, nproc: int, model: str, data: dict, timeout: float = 240) -> list[dict]:
    (tmp_path / "rm.py").write_text(REWARD)
    (tmp_path / "gen.py").write_text(GENERATE)
    from ranks import run_ranks
    argv = ["-m", "polyrl",
            "train", "--hf-checkpoint", model, "--prompt-data", data["train"], "--eval-prompt-data", data["eval"],
            "--eval-interval", str(STEPS), "--custom-rm-path", f"{tmp_path / 'rm.py'}:varied",
            "--custom-generate-function-path", f"{tmp_path / 'gen.py'}:generate", "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "4", "--rollout-max-response-len", "8", "--rollout-stop", "3", "--lr", "1e-3",
            "--num-rollout", str(STEPS), "--seed", "3", "--device", "cpu", "--quiet", "--run-dir", str(tmp_path / name)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    try:
        res = run_ranks(argv, nproc, env, timeout)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the {nproc}-rank polyrl train did not finish in {timeout} s (a rank waiting on a "
                             f"collective the other never issues?): {(e.stderr or '')[-3000:]}") from None
    assert res.returncode == 0, res.stderr[-3000:]
    with open(tmp_path / name / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_two_ranks_log_the_metrics_of_the_whole_step_as_one_rank_does(tiny_model, arith_data, tmp_path):
    """What may differ: time/* and tokens_per_s (wall time), and the trainer's loss, grad_norm, entropy and log-prob
    diffs by fp32 rounding (the ranks' partial sums add in another order); the step-2 samples come from weights equal
    up to that rounding, which moves a sampled token only if its uniform draw falls within ~1e-7 of a boundary."""
    one = run(tmp_path, "one", 1, tiny_model, arith_data)
    two = run(tmp_path, "two", 2, tiny_model, arith_data)
    assert [r["step"] for r in one] == [r["step"] for r in two] == [0, 1, 2]  # the initial eval, then the steps
    for a, b in zip(one, two):
        assert {k for k in COUNTS + MEANS if k in a} == {k for k in COUNTS + MEANS if k in b}, a["step"]
        for k in COUNTS:
            assert a.get(k) == b.get(k), (a["step"], k)
        for k in MEANS:
            if k in a:
                assert b[k] == pytest.approx(a[k], rel=1e-12, abs=1e-12), (a["step"], k)
    steps = [r for r in two if r["step"] > 0]
    assert all(r["reward/samples"] == 16 for r in steps)  # --rollout-batch-size 4 x --n-samples-per-prompt 4
    with open(arith_data["eval"]) as f:
        n_eval = sum(1 for line in f if line.strip())
    assert two[0]["eval/n"] == two[-1]["eval/n"] == n_eval
    # the cases under test happened: errors to add up, rewards that vary, and a mean over unequal response lengths
    assert sum(r["reward/errors"] for r in steps) > 0 and all(0 < r["reward/mean"] < 1 for r in steps)
    assert all(r["truncated_frac"] < 1 for r in steps)


class _Capture:
    """A rank's Dist that records what it would add up (the other rank's half of the sum)."""

    def __init__(self):
        self.rank, self.world, self.sent = 1, 2, None

    def sum(self, values):
        self.sent = list(values)
        return values


class _RankZero(Dist):
    def __init__(self, other: list[float]):
        super().__init__(0, 2)
        self.other = other

    def sum(self, values):
        return [a + b for a, b in zip(values, self.other)]


def test_reward_metrics_of_uneven_ranks_add_counts_and_weigh_means_by_samples():
    # dynamic sampling can leave the ranks with different numbers of scored samples: 6 with mean 0.5, 2 with mean 1.0
    r0 = {"reward/mean": 0.5, "reward/samples": 6.0, "reward/errors": 1.0, "reward/zeros": 3.0, "reward/overlong_penalty": -0.25}
    r1 = {"reward/mean": 1.0, "reward/samples": 2.0, "reward/errors": 2.0, "reward/zeros": 0.0, "reward/overlong_penalty": 0.0}
    cap = _Capture()
    reduce_reward_metrics(r1, cap)
    m = reduce_reward_metrics(r0, _RankZero(cap.sent))
    assert m == pytest.approx({"reward/mean": (6 * 0.5 + 2 * 1.0) / 8, "reward/samples": 8.0, "reward/errors": 3.0,
                               "reward/zeros": 3.0, "reward/overlong_penalty": 6 * -0.25 / 8}, rel=1e-15)


def test_engine_counters_over_ranks():
    # retries are each rank's own requests; a server lost is seen by every rank; restarts happen on rank 0 only
    parts = [{"rollout/retries": 2.0, "rollout/engines_lost": 1.0, "rollout/restarts": 1.0, "rollout/engines_up": 2.0},
             {"rollout/retries": 3.0, "rollout/engines_lost": 1.0, "rollout/engines_up": 1.0,
              "rollout/sampler_logprob_abs_diff_max": 0.5}]
    assert combine_rank_stats(parts) == {"rollout/retries": 5.0, "rollout/engines_lost": 1.0, "rollout/restarts": 1.0,
                                         "rollout/engines_up": 1.0, "rollout/sampler_logprob_abs_diff_max": 0.5}
