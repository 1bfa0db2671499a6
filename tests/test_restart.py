"""A train rank killed mid-run under `torchrun --max-restarts`: the elastic agent restarts the ranks, the run resumes
from the newest complete checkpoint under --save, and ends with the weights of an uninterrupted run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

REWARD = '''
import os, signal
_calls = [0]

def digits(sample):
    """partial credit, and a SIGKILL of rank 1 at its first reward of step 3 on the first attempt"""
    _calls[0] += 1
    if os.environ.get("KILL_RANK") == os.environ["RANK"] and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" \\
            and _calls[0] == int(os.environ["KILL_AT_CALL"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return sum(c.isdigit() for c in sample.response) / 6.0
'''

# torchrun's agent hands every restart the TCPStore of the first attempt, where that attempt's ranks left their gloo
# addresses under the names the next attempt uses: a restarted rank that looked its peer up early dialled a dead port
# (another restart spent) or waited with its peer for the other to dial in (the test below hung for its 600 s)
JOIN = '''
import os, sys, time
import torch, torch.distributed as dist
from polyrl.dist import init_distributed

attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
if attempt == 1 and rank == 1:
    time.sleep(3)  # rank 0 of the second attempt looks rank 1 up before this rank 1 has written its address
init_distributed("cpu", timeout_minutes=1)
store = dist.distributed_c10d._get_default_store()
stale = attempt > 0 and store.check([f"written_by_attempt_{attempt - 1}"])
store.set(f"written_by_attempt_{attempt}", "1")
t = torch.ones(1)
dist.all_reduce(t)
print(f"attempt {attempt} rank {rank}: sum {t.item():g}, previous attempt's key seen: {stale}", flush=True)
if attempt == 0 and rank == 1:
    sys.exit(3)  # the agent restarts both ranks
dist.destroy_process_group()
'''


def test_ranks_restarted_by_torchrun_join_a_process_group_of_their_own_attempt(tmp_path):
    script = tmp_path / "join.py"
    script.write_text(JOIN)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
           str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)  # a stuck join ends at the 1-minute timeout
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in (0, 1):
        assert f"attempt 1 rank {rank}: sum 2, previous attempt's key seen: False" in r.stdout, r.stdout + r.stderr[-3000:]


def run(tmp_path, name, model, data, **env) -> subprocess.CompletedProcess:
    rm = tmp_path / "rm.py"
    rm.write_text(REWARD)
    out = tmp_path / name
    # three restarts allowed: the kill takes one; the others absorb rendezvous that a loaded 2-core machine can fail
    # (gloo's connect refused, seen in clean-clone runs, once with two test workers) without changing what is checked
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
           "-m", "polyrl", "train", "--hf-checkpoint", model, "--prompt-data", data, "--custom-rm-path", f"{rm}:digits",
           "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "6", "--lr", "1e-3",
           "--num-rollout", "4", "--seed", "3", "--device", "cpu", "--quiet", "--run-dir", str(out / "run"),
           "--save", str(out / "ck"), "--save-interval", "1", "--save-hf", str(out / "hf")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path), **env}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_killed_rank_is_restarted_from_the_last_checkpoint_and_ends_where_an_uninterrupted_run_ends(
        tiny_model, arith_data, tmp_path):
    full = run(tmp_path, "full", tiny_model, arith_data["train"])
    assert full.returncode == 0, full.stderr[-3000:]
    # each rank scores 2 prompts x 2 samples = 4 samples per step: call 9 is its first reward of step 3
    killed = run(tmp_path, "killed", tiny_model, arith_data["train"], KILL_RANK="1", KILL_AT_CALL="9")
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "restart 1 of 3: resuming from" in killed.stderr and "step_000002" in killed.stderr
    rows = [json.loads(line) for line in open(tmp_path / "killed" / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # cut at the resumed step: no step logged twice
    restarts = [r.get("restarts", 0) for r in rows]
    assert restarts[:2] == [0, 0] and all(k >= 1 for k in restarts[2:])  # steps 3 and 4 ran after the restart
    want = [json.loads(line) for line in open(tmp_path / "full" / "run" / "metrics.jsonl")]
    for a, b in zip(want, rows):  # the resume-equivalence bound of tests/test_loop.py (fp32, CPU, same seeds)
        for k in ("loss", "reward/mean", "grad_norm", "entropy"):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), (a["step"], k)
    wa, wb = (load_file(str(tmp_path / n / "hf" / "model.safetensors")) for n in ("full", "killed"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=1e-7)
