"""polyrl's OpenMP wait policy (polyrl.cpu_env): every entry point puts it into the environment before torch, and so
its OpenMP runtime, is loaded, and a wait setting the user chose is left as it is."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from polyrl import cpu_env

WAIT = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
# Prints the wait settings at the moment the process first imports torch, and ends it there (torch is never loaded).
AT_TORCH = r"""
import json, os, sys
class AtTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            print(json.dumps({k: os.environ.get(k) for k in %r}), flush=True)
            os._exit(0)
sys.meta_path.insert(0, AtTorch())
""" % (WAIT,)
ENTRIES = {
    "python -m polyrl": "import runpy; sys.argv = ['polyrl', 'eval']; runpy.run_module('polyrl', run_name='__main__')",
    "polyrl (console script)": "sys.argv = ['polyrl', 'eval']; from polyrl.cli import cli; cli()",
    "python -m polyrl.demo": "import runpy; sys.argv = ['demo', '--run-dir', sys.argv[1]]; "
                             "runpy.run_module('polyrl.demo', run_name='__main__')",
}


def env_at_torch_import(entry: str, tmp_path, **env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in WAIT}
    out = subprocess.run([sys.executable, "-c", AT_TORCH + ENTRIES[entry], str(tmp_path / "run")],
                         env={**base, **env}, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip(), f"{entry} never imported torch: {out.stdout}{out.stderr}"
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_each_entry_point_sets_passive_waiting_before_torch_is_imported(entry, tmp_path):
    assert env_at_torch_import(entry, tmp_path) == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None,
                                                    "KMP_BLOCKTIME": None}


@pytest.mark.parametrize("entry", ["python -m polyrl", "python -m polyrl.demo"])
def test_the_users_wait_setting_is_kept(entry, tmp_path):
    assert env_at_torch_import(entry, tmp_path, OMP_WAIT_POLICY="ACTIVE")["OMP_WAIT_POLICY"] == "ACTIVE"
    # GOMP_SPINCOUNT overrides the policy's spin count: the user chose the wait, no policy is added beside it
    assert env_at_torch_import(entry, tmp_path, GOMP_SPINCOUNT="1000") == {
        "OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "1000", "KMP_BLOCKTIME": None}


def test_torchs_openmp_runtime_runs_with_it():
    """libgomp itself reports the setting it read when torch loaded it (OMP_DISPLAY_ENV): no spinning at barriers."""
    base = {k: v for k, v in os.environ.items() if k not in WAIT}
    out = subprocess.run([sys.executable, "-m", "polyrl", "eval"], env={**base, "OMP_DISPLAY_ENV": "VERBOSE"},
                         capture_output=True, text=True, timeout=180)
    assert "OMP_WAIT_POLICY = 'PASSIVE'" in out.stderr and "GOMP_SPINCOUNT = '0'" in out.stderr, out.stderr[-3000:]
    assert out.returncode == 2 and "polyrl eval: error:" in out.stderr  # and the command went on to its own check


def test_apply_sets_only_what_the_user_left_unset():
    env = {"PATH": "/bin"}
    assert cpu_env.apply_cpu_defaults(env) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert env == {"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE"}
    assert cpu_env.apply_cpu_defaults(env) == {}  # a second call (a child of a polyrl process) changes nothing
    for user in ({"OMP_WAIT_POLICY": "active"}, {"GOMP_SPINCOUNT": "10000"}, {"KMP_BLOCKTIME": "1"}):
        env = dict(user)
        assert cpu_env.apply_cpu_defaults(env) == {} and env == user
    assert cpu_env.apply_cpu_defaults({"OMP_WAIT_POLICY": ""}) == {"OMP_WAIT_POLICY": "PASSIVE"}  # empty is unset
    assert cpu_env.wait_env({"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "4"}) == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_a_ray_cluster_gets_the_wait_setting_of_this_process(monkeypatch):
    """Workers of a cluster joined with --ray-address were started elsewhere; the job's runtime_env carries it."""
    from polyrl.config import Config
    from polyrl.orchestration import ray_job

    calls = []

    class FakeRay:
        @staticmethod
        def init(**kw):
            calls.append(kw)

    monkeypatch.setattr(ray_job, "_import_ray", lambda: FakeRay)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    cfg = Config()
    cfg.ray.ray_address = "127.0.0.1:6379"
    assert ray_job._init(cfg, 1) is False
    assert calls[-1]["runtime_env"] == {"env_vars": {"OMP_WAIT_POLICY": "PASSIVE"}}


@pytest.mark.parametrize("command", ["train", "sft", "eval", "serve"])
def test_help_says_what_the_cpu_threads_and_their_wait_are(command, capsys):
    from polyrl.cli import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "POLYRL_CPU_THREADS=N sets the count" in text and "OMP_WAIT_POLICY=PASSIVE, set unless" in text
