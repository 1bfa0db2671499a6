"""--distributed-timeout-minutes: a train rank that stops joining the collectives makes the run fail with one line that
names the collective wait, instead of holding the other ranks for torch's 30 minutes (where torchrun --max-restarts would
have nothing to restart from)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

REWARD = '''
import os, time

def hang(sample):
    """rank 1 never comes back from its first reward (an hour: far past the run's collective timeout)"""
    if os.environ["RANK"] == "1":
        time.sleep(3600)
    return 0.0
'''


@pytest.mark.slow
def test_a_rank_stuck_past_the_distributed_timeout_fails_the_run_with_an_error_naming_the_collective_wait(
        tiny_model, arith_data, tmp_path):
    rm = tmp_path / "rm.py"
    rm.write_text(REWARD)
    # 0.5 minutes: long beside the start-up skew of two ranks on a loaded 2-core machine, short beside the test's bound
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
           "-m", "polyrl", "train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"],
           "--custom-rm-path", f"{rm}:hang", "--rm-timeout", "0", "--distributed-timeout-minutes", "0.5",
           "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
           "--num-rollout", "2", "--device", "cpu", "--quiet", "--run-dir", str(tmp_path / "run")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    # the bound: without the flag rank 0 would wait torch's default 30 minutes for rank 1, and this would time out
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if "waited --distributed-timeout-minutes" in ln]
    assert len(lines) == 1, r.stderr[-3000:]  # rank 0 waited; rank 1 never reached a collective
    # the line names the torch collective and polyrl's line that called it, the step, and what to do
    assert re.match(r"polyrl train: error: rank 0 waited --distributed-timeout-minutes 0\.5 in a collective "
                    r"\([a-z_]+, from polyrl/[\w/]+\.py:\d+ \w+\) in step 1 \(", lines[0]), lines
    assert lines[0].endswith("(then raise --distributed-timeout-minutes)"), lines


def test_groups_made_after_the_default_one_get_its_timeout():
    """Megatron makes its TP / PP / CP / EP / DP groups itself: it is handed the default group's timeout
    (dist.group_timeout_minutes, passed to megatron's initialize_model_parallel), not megatron-core's 30 minutes."""
    code = ("from polyrl import dist; print(dist.group_timeout_minutes()); dist.init_distributed('cpu', timeout_minutes=0.25); "
            "print(dist.group_timeout_minutes())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["30.0", "0.25"]
