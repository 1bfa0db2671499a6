"""`polyrl train --async` (polyrl/loop_async.py) on CPU: the same data and seeds as the synchronous
loop, the staleness each sample carries and its bound, engine servers updated while they generate,
resume, and the flag checks. Servers are started on loopback by the run and stopped by it."""

from __future__ import annotations

import json
import threading

import pytest

from polyrl.cli import main
from polyrl.loop_async import StalenessError, staleness
from polyrl.dist import Dist
from polyrl.types import Sample

RECORDER = '''
import json, os
def record(sample):
    with open(os.environ["POLYRL_TEST_SAMPLES"], "a") as f:
        f.write(json.dumps([sample.prompt_ids, sample.response_ids, sample.weight_version]) + "\\n")
    return sum(c.isdigit() for c in sample.response) / 8.0
'''
GROUP = 4 * 4  # samples per step: --rollout-batch-size 4 x --n-samples-per-prompt 4


def _train(tiny_model, arith_data, tmp_path, monkeypatch, name: str, *extra: str, steps: int = 3) -> tuple[list, list]:
    rm = tmp_path / "rm.py"
    rm.write_text(RECORDER)
    out = tmp_path / f"{name}.jsonl"
    monkeypatch.setenv("POLYRL_TEST_SAMPLES", str(out))
    run = tmp_path / name
    assert main(["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--custom-rm-path", f"{rm}:record",
                 "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6",
                 "--num-rollout", str(steps), "--quiet", "--seed", "3", "--device", "cpu", "--run-dir", str(run), *extra]) == 0
    rows = [json.loads(line) for line in open(out)]
    return [rows[k:k + GROUP] for k in range(0, len(rows), GROUP)], [json.loads(line) for line in open(run / "metrics.jsonl")]


@pytest.mark.slow
def test_one_step_off_draws_and_seeds_like_the_synchronous_loop(tiny_model, arith_data, tmp_path, monkeypatch):
    # lr 1e-12: Adam moves each weight by ~1e-12, below one fp32 ulp of weights ~1e-2, so the policy stays
    # bit-identical and generation must give the synchronous loop's samples exactly, whatever version ran it
    sync, _ = _train(tiny_model, arith_data, tmp_path, monkeypatch, "sync", "--lr", "1e-12")
    asyn, m = _train(tiny_model, arith_data, tmp_path, monkeypatch, "async", "--lr", "1e-12", "--async")
    assert [[r[:2] for r in step] for step in asyn] == [[r[:2] for r in step] for step in sync]
    # one-step-off: step 1 from the initial weights, step s from the weights after step s - 2
    assert [sorted({r[2] for r in step}) for step in asyn] == [[0], [0], [1]]
    assert [(x["staleness/mean"], x["staleness/max"]) for x in m] == [(0, 0), (1, 1), (1, 1)]
    assert all("time/wait_rollout" in x and "time/weight_sync" in x for x in m)


@pytest.mark.slow
def test_two_servers_stay_within_max_staleness_and_report_versions(tiny_model, arith_data, tmp_path, monkeypatch):
    steps, k = 4, 2
    got, m = _train(tiny_model, arith_data, tmp_path, monkeypatch, "servers", "--lr", "1e-3", "--async", "--max-staleness",
                    str(k), "--rollout-engine", "server", "--rollout-num-engines", "2", "--check-weight-update-equal",
                    steps=steps)
    assert len(got) == steps
    for s, step in enumerate(got):  # versions come from the servers' meta_info: the weights that produced each response
        versions = {r[2] for r in step}
        assert versions and all(v is not None and max(0, s - k) <= v <= s for v in versions), (s, versions)
    assert all(x["staleness/max"] <= k and x["staleness/unknown"] == 0 for x in m)
    assert m[0]["staleness/max"] == 0 and m[-1]["rollout/engines_up"] == 2
    # generation ran ahead of training: step 2 is queued before step 1 trains and its requests go out as soon as step 1
    # is scored, while step 1 still trains, so they meet version 0 (a loop that waits for each step's weights before
    # generating the next never shows a lag)
    assert any(x["staleness/max"] >= 1 for x in m), [x["staleness/max"] for x in m]
    assert any(r[2] < s for s, step in enumerate(got) for r in step)


@pytest.mark.slow
def test_resume_draws_the_steps_that_were_queued_but_not_trained(tiny_model, arith_data, tmp_path, monkeypatch):
    full, _ = _train(tiny_model, arith_data, tmp_path, monkeypatch, "full", "--lr", "1e-3", "--async", "--max-staleness", "2",
                     steps=4)
    save = tmp_path / "ckpt"
    _train(tiny_model, arith_data, tmp_path, monkeypatch, "first", "--lr", "1e-3", "--async", "--max-staleness", "2",
           "--save", str(save), "--save-interval", "2", steps=4)
    # the checkpoint after step 2 was written while steps 3 and 4 were queued: a resume draws them again
    resumed, m = _train(tiny_model, arith_data, tmp_path, monkeypatch, "resumed", "--lr", "1e-3", "--async", "--max-staleness",
                        "2", "--load", str(save / "step_000002"), steps=4)
    assert [sorted({tuple(r[0]) for r in step}) for step in resumed] == [sorted({tuple(r[0]) for r in step}) for step in full[2:]]
    assert [x["step"] for x in m] == [3, 4]
    assert {r[2] for r in resumed[0]} == {2}  # generated with the resumed weights


def test_a_sample_past_the_bound_stops_the_run():
    d = Dist(0, 1)
    s = [Sample([1], [2], [0.0], "stop", weight_version=v) for v in (4, 5, None)]
    assert staleness(d, s, 5, 1) == {"staleness/mean": 0.5, "staleness/max": 1, "staleness/unknown": 1}
    with pytest.raises(StalenessError, match="step 7 .* 2 versions old, past --max-staleness 1"):
        staleness(d, s, 6, 1)


def test_max_staleness_without_async_is_a_flag_error(tiny_model, arith_data, capsys):
    assert main(["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--rm-type", "arithmetic",
                 "--max-staleness", "2", "--device", "cpu"]) == 2
    assert "--max-staleness 2 only applies with --async" in capsys.readouterr().err


SLOW_RM = '''
import os, threading, time
def slow(sample):  # a reward that waits on something else (a sandbox, a remote verifier): 10 ms a sample
    with open(os.environ["POLYRL_TEST_REWARD_THREADS"], "a") as f:
        f.write(threading.current_thread().name + "\\n")
    time.sleep(0.01)
    return float(sample.response.strip().isdigit())
'''


@pytest.mark.slow
def test_a_slow_reward_runs_on_the_rollout_thread_beside_training(tiny_model, arith_data, tmp_path, monkeypatch):
    # How much wall time this saves is a timing claim, measured in bench/ (bench/disaggregated.py --reward-sleep-ms,
    # bench/RESULTS.md): on a loaded 2-core machine the saving drowns in noise. Here: where the reward runs.
    rm = tmp_path / "slow.py"
    rm.write_text(SLOW_RM)
    threads = tmp_path / "threads.txt"
    monkeypatch.setenv("POLYRL_TEST_REWARD_THREADS", str(threads))
    # --rm-timeout 0 runs a sync reward inline on the thread that scores (with a deadline it runs on a helper thread
    # started by that one), so the thread each call records is the one that scored it
    assert main(["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--custom-rm-path",
                 f"{rm}:slow", "--rm-timeout", "0", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
                 "--rollout-max-response-len", "6", "--num-rollout", "3", "--quiet", "--seed", "3", "--device", "cpu",
                 "--rollout-engine", "server", "--async", "--run-dir", str(tmp_path / "run")]) == 0
    m = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    # step 1 from the initial weights; later steps lag by at most one version (0 when a server took the new weights
    # before the next step's requests reached it: versions are what the server reports, not a schedule)
    assert m[0]["staleness/max"] == 0 and all(x["staleness/max"] <= 1 for x in m)
    # every call of every step ran off the trainer's thread (the one that called main): on the rollout thread
    names = open(threads).read().split()
    assert len(names) == 3 * 16 and threading.main_thread().name not in names, sorted(set(names))
    for x in m:
        # time/reward_overlapped is the rollout thread's scoring: 16 calls, each sleeping >= 10 ms (a sleep never
        # returns early, so this lower bound holds on any machine)
        assert x["time/reward_overlapped"] >= 16 * 0.01, x
        assert x["time/step"] > 0 and "time/wait_rollout" in x and "time/rollout_overlapped" in x
