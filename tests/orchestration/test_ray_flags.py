"""Ray placement flags checked for their effect: --ray-address (the run joins the cluster it names: a two-node cluster
the test starts with `ray start` on loopback), --actor-num-nodes (one train actor per node there), --dist-backend
(the process group the actors train in) and --ray-num-cpus refused where a cluster is joined (its effect on a local
instance is checked in test_ray_job.py, on that file's Ray run). Every process is bounded
in time and the cluster is stopped by the pids the test started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from polyrl.dist import free_port

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

RECORDER = '''
import json, os
def record(sample):
    """what the train actor scoring this sample runs on"""
    import ray, torch.distributed as dist
    ctx = ray.get_runtime_context()
    with open(PLACES, "a") as f:
        f.write(json.dumps({"rank": int(os.environ["RANK"]), "node": ctx.get_node_id(), "gcs": ctx.gcs_address,
                            "assigned": ctx.get_assigned_resources(), "cpus": ray.cluster_resources().get("CPU"),
                            "backend": dist.get_backend(), "world": dist.get_world_size()}) + "\\n")
    return sum(c.isdigit() for c in sample.response) / 8.0
'''
ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}


def polyrl(args: list[str], tmp_path, name: str, env: dict) -> tuple[subprocess.CompletedProcess, list[dict]]:
    places = tmp_path / f"{name}.jsonl"
    rm = tmp_path / "rm.py"
    rm.write_text(f"PLACES = {str(places)!r}\n{RECORDER}")  # a cluster's actors have its environment, not this one's
    env = {**os.environ, **ENV, **env}
    res = subprocess.run([sys.executable, "-m", "polyrl", "train", "--custom-rm-path", f"{rm}:record",
                          "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
                          "--num-rollout", "1", "--device", "cpu", "--quiet", "--run-dir", str(tmp_path / name),
                          "--use-ray", "--colocate", *args], capture_output=True, text=True, timeout=300, env=env,
                         cwd=tmp_path)
    return res, [json.loads(line) for line in open(places)] if places.exists() else []


def ray_node(args: list[str], temp_dir: str, log: str) -> subprocess.Popen:
    """One `ray start --block` node on loopback with one polyrl slot (a CPU "GPU"); its own session, so that it and the
    raylet, GCS and workers it starts are stopped together. Its output goes to `log`."""
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--node-ip-address",
                                 "127.0.0.1", "--num-cpus", "1", "--resources", '{"polyrl_slot": 1}',
                                 "--object-store-memory", str(100 * 2**20), "--disable-usage-stats",
                                 "--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port",
                                 str(free_port()), "--runtime-env-agent-port", str(free_port()),
                                 "--metrics-export-port", str(free_port()), *args],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **ENV},
                                start_new_session=True, cwd=temp_dir)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs[::-1]:  # SIGTERM: `ray start --block` stops the processes it started (worker node first)
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs[::-1]:
        try:
            p.wait(timeout=5)  # it takes its time (over 30 s seen) to stop; its process group goes down together
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


@pytest.fixture
def cluster():
    """A head and a second node on loopback; yields the head's address once the head has written it (60 s bound). The
    ports are free when chosen but may be taken before Ray binds them (another test's Ray beside this one): a head
    that exits is started again on fresh ports, three tries in all, and the last one's output names the cause."""
    temp = tempfile.mkdtemp(prefix="prf_")  # Ray's unix socket paths must stay short
    log = os.path.join(temp, "nodes.log")
    procs: list[subprocess.Popen] = []
    try:
        for attempt in range(3):
            if os.path.exists(os.path.join(temp, "ray_current_cluster")):
                os.remove(os.path.join(temp, "ray_current_cluster"))  # a failed head's
            port = free_port()
            procs = [ray_node(["--head", "--port", str(port), "--include-dashboard", "false", "--temp-dir", temp], temp,
                              log)]
            deadline = time.monotonic() + 60
            while not os.path.exists(os.path.join(temp, "ray_current_cluster")) and procs[0].poll() is None:
                assert time.monotonic() < deadline, "the Ray head did not write its address within 60 s"
                time.sleep(0.5)
            if procs[0].poll() is None:
                break
            with open(log, errors="replace") as f:
                tail = f.read()[-2000:]
            assert attempt < 2, f"ray start --head exited with {procs[0].returncode} three times; its output:\n{tail}"
        address = f"127.0.0.1:{port}"
        procs.append(ray_node(["--address", address], temp, log))
        yield address
    finally:
        stop(procs)


def test_ray_address_joins_that_cluster_with_a_train_actor_per_node_in_a_gloo_group(cluster, tiny_model, arith_data,
                                                                                   tmp_path):
    # the second node registers while the placement group waits for its bundle (bounded by the startup timeout)
    res, places = polyrl(["--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--ray-address", cluster,
                          "--actor-num-nodes", "2", "--dist-backend", "gloo", "--rollout-engine-startup-timeout", "120"],
                         tmp_path, "joined", env={"RAY_ADDRESS": ""})
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert {p["rank"] for p in places} == {0, 1}
    # the cluster --ray-address named (its GCS reports the host's address, on the port the test gave it), not a local one
    assert {p["gcs"].rpartition(":")[2] for p in places} == {cluster.rpartition(":")[2]}
    assert not (tmp_path / "joined" / "ray").exists()  # (a local instance keeps its files there)
    by_rank = {p["rank"]: p["node"] for p in places}
    assert by_rank[0] != by_rank[1]  # each node has one slot: --actor-num-nodes 2 is one actor on each
    assert all(p["assigned"] == {"polyrl_slot": 1.0} for p in places), places
    assert all(p["backend"] == "gloo" and p["world"] == 2 for p in places), places
    assert all(p["cpus"] == 2.0 for p in places)  # the nodes' own CPUs (1 each)


def test_ray_num_cpus_with_a_cluster_to_join_is_refused(tiny_model, arith_data, tmp_path, capsys, monkeypatch):
    from polyrl.cli import main
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--rm-type", "arithmetic",
                 "--device", "cpu", "--use-ray", "--colocate", "--ray-address", "127.0.0.1:1", "--ray-num-cpus", "2",
                 "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "--ray-num-cpus" in err and "127.0.0.1:1" in err and "drop --ray-num-cpus" in err, err
