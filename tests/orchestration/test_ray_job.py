"""`polyrl train --use-ray` on a local Ray instance (CPU, gloo; "GPUs" are the `polyrl_slot` custom
resource): the same samples and losses as the torchrun run, a checkpoint that resumes without
Ray, colocated vs disaggregated placement, a killed train actor, and an OpenAI-SDK agent trained under Ray. Every
run is a subprocess bounded in time; each leaves no actor, server or Ray process behind (checked)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

RECORDER = '''
import json, os, sys, time
def record(sample):
    ray = sys.modules.get("ray")  # a Ray actor's: the CPUs of the instance and the resources this actor holds
    place = [ray.cluster_resources().get("CPU"), ray.get_runtime_context().get_assigned_resources()] \\
        if ray is not None and ray.is_initialized() else [None, None]
    with open(os.environ["POLYRL_TEST_SAMPLES"], "a") as f:
        f.write(json.dumps([sample.prompt_ids, sample.response_ids, sample.rollout_logprobs, sample.weight_version,
                            *place]) + "\\n")
    time.sleep(float(os.environ.get("POLYRL_TEST_RM_SLEEP", "0")))
    return sum(c.isdigit() for c in sample.response) / 8.0
'''
# Both placements run the same FP32 transformers model on CPU with the same per-sample seeds; only the batch
# composition (hence BLAS reduction order) can differ: logprobs agree to a few fp32 ulp, 1e-4 leaves ~100x margin.
LOGPROB_TOL = 1e-4


def polyrl(args: list[str], tmp_path, name: str, timeout: float = 240, env: dict | None = None,
           launcher: list[str] | None = None) -> tuple[subprocess.CompletedProcess, list, list]:
    rm = tmp_path / "rm.py"
    rm.write_text(RECORDER)
    samples = tmp_path / f"{name}.jsonl"
    run = tmp_path / name
    env = {**os.environ, "POLYRL_TEST_SAMPLES": str(samples), "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1", **(env or {})}
    res = subprocess.run([*(launcher or [sys.executable, "-m"]), "polyrl", "train", "--custom-rm-path", f"{rm}:record",
                          "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "6",
                          "--lr", "1e-3", "--seed", "3", "--device", "cpu", "--quiet", "--run-dir", str(run), *args],
                         capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)
    rows = [json.loads(line) for line in open(samples)] if samples.exists() else []
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")] if (run / "metrics.jsonl").exists() else []
    return res, rows, metrics


def base(data: dict, model: str) -> list[str]:
    return ["--hf-checkpoint", model, "--prompt-data", data["train"], "--num-rollout", "2"]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited
        return f.read().split()[2] != "Z"


def assert_nothing_left(run_dir) -> None:
    pids = json.load(open(run_dir / "ray_actors.json"))
    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids["train"] + pids["engines"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids["train"] + pids["engines"]), pids


@pytest.fixture(scope="module")
def runs(tiny_model, arith_data, tmp_path_factory):
    """The torchrun run (2 ranks, 1 launched server) and the Ray run (2 train actors, 1 engine actor, a local
    instance of --ray-num-cpus 3)."""
    tmp = tmp_path_factory.mktemp("ray")
    common = base(arith_data, tiny_model) + ["--rollout-engine", "server", "--save", str(tmp / "ckpt")]
    torchrun = polyrl(common + ["--rollout-num-engines", "1"], tmp, "torchrun",
                      launcher=[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m"])
    ray_run = polyrl(common[:-1] + [str(tmp / "ckpt_ray"), "--use-ray", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus",
                                    "1", "--ray-num-cpus", "3"], tmp, "ray", env={"RAY_ADDRESS": ""})
    return tmp, torchrun, ray_run


def test_ray_equals_torchrun_and_its_checkpoint_resumes_without_ray(runs, tiny_model, arith_data):
    tmp, (t_res, t_rows, t_m), (r_res, r_rows, r_m) = runs
    assert t_res.returncode == 0, t_res.stderr[-3000:]
    assert r_res.returncode == 0, r_res.stderr[-3000:]
    assert len(r_rows) == len(t_rows) == 2 * 4 * 2
    # the two ranks append in any order: compare the samples as sets, logprobs within LOGPROB_TOL
    key = lambda r: (r[0], r[1])  # noqa: E731
    t_by, r_by = {json.dumps(key(r)): r for r in t_rows}, {json.dumps(key(r)): r for r in r_rows}
    assert t_by.keys() == r_by.keys()
    for k in t_by:
        assert max(abs(a - b) for a, b in zip(t_by[k][2], r_by[k][2])) < LOGPROB_TOL
    assert len(r_m) == len(t_m) == 2
    for a, b in zip(t_m, r_m):  # the same ranks, the same gloo sums: the same arithmetic
        for k in ("loss", "reward/mean", "grad_norm", "entropy"):
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), k
    assert_nothing_left(tmp / "ray")
    assert (tmp / "ray" / "ray").is_dir()  # Ray's temp dir and logs under the run dir
    # --ray-num-cpus sized the local instance; each train actor (they score the samples) holds one polyrl slot
    assert all(r[4] == 3.0 and r[5] == {"polyrl_slot": 1.0} for r in r_rows), r_rows[0][4:]
    assert all(r[4] is None for r in t_rows)
    # the Ray run's checkpoint resumes in a plain process (embedded engine, one rank: DCP re-shards)
    res, _, m = polyrl(["--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--num-rollout", "3",
                        "--load", str(tmp / "ckpt_ray")], tmp, "resumed")
    assert res.returncode == 0, res.stderr[-3000:]
    assert [x["step"] for x in m] == [3]


def test_colocated_and_disaggregated_give_the_same_first_step(runs, tiny_model, arith_data):
    tmp, _, (r_res, r_rows, _) = runs
    assert r_res.returncode == 0
    res, rows, m = polyrl(base(arith_data, tiny_model) + ["--num-rollout", "1", "--use-ray", "--colocate",
                                                          "--actor-num-gpus-per-node", "2"], tmp, "colocated")
    assert res.returncode == 0, res.stderr[-3000:]
    disagg = {json.dumps(r[:2]): r[2] for r in r_rows if r[3] == 0}  # step 1: weights version 0
    first = {json.dumps(r[:2]): r[2] for r in rows}
    assert first.keys() == disagg.keys()
    for k in first:
        assert max(abs(a - b) for a, b in zip(first[k], disagg[k])) < LOGPROB_TOL
    assert_nothing_left(tmp / "colocated")


def test_a_killed_train_actor_ends_the_run_with_a_message(tiny_model, arith_data, tmp_path):
    rm = tmp_path / "rm.py"
    rm.write_text(RECORDER)
    run = tmp_path / "killed"
    env = {**os.environ, "POLYRL_TEST_SAMPLES": str(tmp_path / "s.jsonl"), "POLYRL_TEST_RM_SLEEP": "0.05",
           "RAY_AUTH_MODE": "disabled"}
    p = subprocess.Popen([sys.executable, "-m", "polyrl", "train", "--hf-checkpoint", tiny_model, "--prompt-data",
                          arith_data["train"], "--custom-rm-path", f"{rm}:record", "--rollout-batch-size", "4",
                          "--n-samples-per-prompt", "2", "--rollout-max-response-len", "6", "--num-rollout", "200", "--device",
                          "cpu", "--quiet", "--run-dir", str(run), "--use-ray", "--actor-num-gpus-per-node", "2",
                          "--rollout-engine", "server", "--rollout-num-gpus", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    try:
        # a Ray cluster, a launched server and two train actors start first: on a loaded 2-core machine (make test's
        # workers beside it) that took over 120 s once, so the bound is generous; it still ends a stuck start
        wait = 240
        deadline = time.monotonic() + wait
        while not (run / "metrics.jsonl").exists() and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.2)  # training has started: both ranks are in the loop
        if not (run / "metrics.jsonl").exists():
            code = p.poll()
            p.kill()
            out = p.communicate(timeout=30)[0]
            why = f"timed out after {wait} s" if code is None else f"exited {code}"
            raise AssertionError(f"the run never trained a step ({why}): {out[-3000:]}")
        pids = json.load(open(run / "ray_actors.json"))
        os.kill(pids["train"][1], signal.SIGKILL)
        t0 = time.monotonic()
        out, _ = p.communicate(timeout=90)
        assert time.monotonic() - t0 < 90
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode not in (0, None)
    assert "train actor 1" in out and "died" in out, out[-3000:]
    assert_nothing_left(run)


KILLER = '''
import json, os, signal, sys
_calls = [0]
def digits(sample):
    """partial credit, and a SIGKILL of train actor 1 at its first reward of step 3 on the first attempt; writes the
    Ray resources the scoring train actor holds"""
    _calls[0] += 1
    with open(os.environ["POLYRL_TEST_HELD"], "a") as f:
        f.write(json.dumps(sys.modules["ray"].get_runtime_context().get_assigned_resources()) + "\\n")
    if os.environ["RANK"] == "1" and os.environ.get("POLYRL_RESTART_COUNT") == "0" and _calls[0] == 9:
        os.kill(os.getpid(), signal.SIGKILL)
    return sum(c.isdigit() for c in sample.response) / 6.0
'''


def test_max_restarts_resumes_the_train_actors_and_keeps_the_engine_actors(tiny_model, arith_data, tmp_path):
    """With --colocate --rollout-engine server: each engine actor sits in its train actor's bundle (half a slot each;
    the train actor attaches to it as a colocated external engine: sleep/wake, weights over gloo) and outlives it."""
    rm = tmp_path / "rm.py"
    rm.write_text(KILLER)
    run = tmp_path / "run"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1", "POLYRL_TEST_HELD": str(tmp_path / "held")}
    p = subprocess.run([sys.executable, "-m", "polyrl", "train", "--hf-checkpoint", tiny_model, "--prompt-data",
                        arith_data["train"], "--custom-rm-path", f"{rm}:digits", "--rollout-batch-size", "4",
                        "--n-samples-per-prompt", "2", "--rollout-max-response-len", "6", "--lr", "1e-3",
                        "--num-rollout", "4", "--seed", "3", "--device", "cpu", "--quiet", "--run-dir", str(run),
                        "--save", str(tmp_path / "ck"), "--save-interval", "1", "--use-ray",
                        "--actor-num-gpus-per-node", "2", "--colocate", "--rollout-engine", "server", "--ray-num-cpus", "3",
                        "--max-restarts", "1"], capture_output=True, text=True, env={**env, "RAY_ADDRESS": ""},
                       cwd=tmp_path, timeout=400)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "train actor 1 (rank 1) died" in p.stderr and "restart 1 of 1: resuming from" in p.stderr
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and [r.get("restarts", 0) for r in rows] == [0, 0, 1, 1]
    # the engine actor stayed up and holds the resumed weights: the restarted trainer's log-probs are the engine's
    actors = json.load(open(run / "ray_actors.json"))
    assert actors["restart"] == 1 and len(actors["engines"]) == 2
    held = [json.loads(line) for line in open(tmp_path / "held")]
    assert held and all(h == {"polyrl_slot": 0.5} for h in held), held[:2]
    logs = [f for f in os.listdir(run / "engines") if f.endswith(".log")]
    assert logs and all(open(run / "engines" / f).read().count("listening on") == 1 for f in logs)  # started once
    assert all(r["train_rollout_logprob_abs_diff_max"] < LOGPROB_TOL for r in rows)
    assert_nothing_left(run)


def test_an_openai_agent_trains_under_ray_against_an_engine_actor(tmp_path):
    """--agent-function-path under --use-ray: each train actor runs its gateway and its agents, whose calls go to the
    engine actor's server (disaggregated); the trajectories train, and the trainer's log-probs are the engine's."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    from chat_model import PLAIN_AGENT, make_chat_model
    model = make_chat_model(str(tmp_path / "chat_model"))
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"add {a}+{a}", "label": str(2 * a)}) + "\n" for a in range(8)))
    fn = tmp_path / "agent.py"
    fn.write_text(PLAIN_AGENT)
    run = tmp_path / "run"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1", "RAY_ADDRESS": ""}
    p = subprocess.run([sys.executable, "-m", "polyrl", "train", "--hf-checkpoint", model, "--prompt-data", str(data),
                        "--agent-function-path", f"{fn}:plain", "--rollout-batch-size", "2",
                        "--n-samples-per-prompt", "2", "--rollout-max-response-len", "40", "--num-rollout", "1",
                        "--lr", "1e-3", "--seed", "1", "--device", "cpu", "--quiet", "--run-dir", str(run), "--use-ray",
                        "--actor-num-gpus-per-node", "1", "--rollout-engine", "server", "--rollout-num-gpus", "1",
                        "--ray-num-cpus", "2"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    (m,) = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert m["agent/trajectories"] == 4 and m["agent/failed"] == 0 and m["agent/calls"] == 2 and "pg_loss" in m
    assert m["train_rollout_logprob_abs_diff_max"] < LOGPROB_TOL
    assert_nothing_left(run)
