"""`polyrl train --use-ray` on one GPU, against the same runs without Ray: the embedded engine inside the train actor
(--colocate), a `polyrl serve` engine actor sharing the train actor's GPU by fractional bundles (--colocate
--rollout-engine server), and --max-restarts with the train actor killed mid-step. Every run is a subprocess bounded
in time, with --true-on-policy so that two processes with the same seeds sample the same tokens (its kernels do not
depend on the batch, and its log-probs are the trainer's own). Needs Ray on the GPU machine (docs/ray.md says how to
bring its wheel there); `make test-gpu-ray` runs it, and skips it without Ray.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import make_model_dir

pytest.importorskip("ray")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu on a GPU machine)")]

RECORDER = '''
import json, os, signal, sys
_calls = [0]
def ids(sample):
    """partial credit from the token ids; writes where it ran (a Ray actor: its resources and CUDA_VISIBLE_DEVICES) and,
    when POLYRL_TEST_KILL_AT is set, SIGKILLs its train actor at that call of the first attempt"""
    _calls[0] += 1
    ray = sys.modules.get("ray")
    held = ray.get_runtime_context().get_assigned_resources() if ray is not None and ray.is_initialized() else None
    with open(os.environ["POLYRL_TEST_SAMPLES"], "a") as f:
        f.write(json.dumps([held, os.environ.get("CUDA_VISIBLE_DEVICES")]) + "\\n")
    kill = int(os.environ.get("POLYRL_TEST_KILL_AT", "0"))
    if kill and os.environ.get("POLYRL_RESTART_COUNT") == "0" and _calls[0] == kill:
        os.kill(os.getpid(), signal.SIGKILL)
    return (sum(sample.response_ids) % 10) / 10.0
'''

# what two processes may disagree on: seconds, CUDA graph counts (kept per address of the weights and KV cache) and the
# allocator's peaks (memory/*: Ray's actor and a plain process hold different other allocations)
TIMED = ("time/", "memory/", "perf/")


def untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not (k.startswith(TIMED) or k.endswith(("_s", "tokens_per_s")) or "graph_" in k
                                                or k in ("restarts",))} for r in rows]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("qwen3") / "m", arch="qwen3", hidden=128, layers=2, tied=True)


def train(args: list[str], tmp, name: str, model: str, data: str, env: dict | None = None, timeout: float = 240):
    rm = tmp / "rm.py"
    rm.write_text(RECORDER)
    run, samples = tmp / name, tmp / f"{name}.jsonl"
    env = {**os.environ, "POLYRL_TEST_SAMPLES": str(samples), "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": "", **(env or {})}
    res = subprocess.run([sys.executable, "-m", "polyrl", "train", "--hf-checkpoint", model, "--prompt-data", data,
                          "--custom-rm-path", f"{rm}:ids", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
                          "--rollout-max-response-len", "16", "--lr", "1e-3", "--seed", "3", "--device", "cuda",
                          "--true-on-policy", "--rollout-mem-fraction", "0.1", "--quiet", "--run-dir", str(run), *args],
                         capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    where = [json.loads(line) for line in open(samples)] if samples.exists() else []
    return rows, where, res


def assert_same_run(plain: list[dict], ray_rows: list[dict]) -> None:
    a, b = untimed(plain), untimed(ray_rows)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    for step, (x, y) in enumerate(zip(a, b), 1):
        assert x == y, (step, {k: (x.get(k), y.get(k)) for k in set(x) | set(y) if x.get(k) != y.get(k)})
    assert all(r["train_rollout_logprob_abs_diff_max"] == 0.0 for r in ray_rows)


def test_colocated_embedded_engine_equals_the_plain_run_on_cuda(model, arith_data, tmp_path):
    plain, where_plain, _ = train(["--num-rollout", "3"], tmp_path, "plain", model, arith_data["train"])
    ray_rows, where, _ = train(["--num-rollout", "3", "--use-ray", "--colocate"], tmp_path, "ray", model, arith_data["train"])
    assert_same_run(plain, ray_rows)
    assert all(w == [None, os.environ.get("CUDA_VISIBLE_DEVICES")] for w in where_plain)
    # the train actor held one whole GPU, and Ray pointed CUDA_VISIBLE_DEVICES at it
    assert all(w[0] == {"GPU": 1.0} and w[1] is not None and len(w[1].split(",")) == 1 for w in where), where[:2]


def test_colocated_server_actor_shares_the_gpu_and_equals_the_plain_shared_server_run(model, arith_data, tmp_path):
    plain, _, _ = train(["--num-rollout", "3", "--rollout-engine", "server"], tmp_path, "plain", model, arith_data["train"])
    ray_rows, where, _ = train(["--num-rollout", "3", "--use-ray", "--colocate", "--rollout-engine", "server"],
                               tmp_path, "ray", model, arith_data["train"])
    assert_same_run(plain, ray_rows)
    assert all(w[0] == {"GPU": 0.5} for w in where), where[:2]  # half of the bundle's GPU; the engine actor has the rest
    actors = json.load(open(tmp_path / "ray" / "ray_actors.json"))
    assert len(actors["engines"]) == 1 and len(actors["train"]) == 1


def test_max_restarts_resumes_a_killed_train_actor_on_cuda(model, arith_data, tmp_path):
    """The train actor is SIGKILLed at its first reward of step 3 (4 prompts x 4 samples a step); the restarted actor
    gets the GPU the dead one held, resumes from step 2's checkpoint and ends where an unbroken run ends."""
    args = ["--num-rollout", "4", "--save", str(tmp_path / "ck"), "--save-interval", "1", "--use-ray", "--colocate"]
    rows, _, res = train(args + ["--max-restarts", "1"], tmp_path, "killed", model, arith_data["train"],
                         env={"POLYRL_TEST_KILL_AT": str(2 * 16 + 1)}, timeout=400)
    assert "train actor 0 (rank 0) died" in res.stderr and "restart 1 of 1: resuming from" in res.stderr, res.stderr[-3000:]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and [r.get("restarts", 0) for r in rows] == [0, 0, 1, 1]
    whole, _, _ = train(["--num-rollout", "4"], tmp_path, "whole", model, arith_data["train"])
    # steps 3-4 after the resume are the unbroken run's steps 3-4: the checkpoint held weights, optimizer and data order
    for x, y in zip(untimed(rows)[2:], untimed(whole)[2:]):
        assert x == y, {k: (x.get(k), y.get(k)) for k in set(x) | set(y) if x.get(k) != y.get(k)}
