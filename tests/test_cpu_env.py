"""polyrl's OpenMP wait policy and thread count (polyrl.cpu_env, polyrl.cpu_governor): every entry point decides the
wait before torch, and so its OpenMP runtime, is loaded (a single-process CPU command spins, with a thread count that
follows the machine's load; everything else, and every process one starts, waits passively), and a wait setting the
user chose is left as it is."""

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
    # make test fixes POLYRL_CPU_THREADS; these runs choose their threads as a user's do unless `env` says otherwise
    base = {k: v for k, v in os.environ.items() if k not in WAIT and k != "POLYRL_CPU_THREADS"}
    out = subprocess.run([sys.executable, "-c", AT_TORCH + ENTRIES[entry], str(tmp_path / "run")],
                         env={**base, **env}, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip(), f"{entry} never imported torch: {out.stdout}{out.stderr}"
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_each_entry_point_sets_passive_waiting_before_torch_is_imported(entry, tmp_path):
    """With the thread count fixed (POLYRL_CPU_THREADS) nothing follows the load: the threads wait passively."""
    assert env_at_torch_import(entry, tmp_path, POLYRL_CPU_THREADS="2") == {
        "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None, "KMP_BLOCKTIME": None}


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_a_single_process_command_loads_openmp_spinning(entry, tmp_path):
    """polyrl eval (and the demo's commands) on their own: libgomp's own spinning wait, no setting added before it."""
    assert env_at_torch_import(entry, tmp_path) == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None,
                                                    "KMP_BLOCKTIME": None}


@pytest.mark.parametrize("argv, env, want", [
    (["polyrl", "train"], {}, True), (["polyrl", "sft"], {}, True), (["polyrl", "eval"], {}, True),
    (["polyrl", "serve"], {}, False),  # a server beside a trainer: both would spin on the same cores
    (["polyrl", "train", "--async"], {}, False),  # two threads of work in one process
    (["polyrl", "train", "--use-ray"], {}, False),
    (["polyrl", "train"], {"WORLD_SIZE": "2"}, False),  # a torchrun rank
    (["polyrl", "train"], {"POLYRL_CPU_THREADS": "2"}, False),
    (["polyrl", "train"], {"POLYRL_CPU_GOVERNOR": "0"}, False),
    (["polyrl", "train"], {"OMP_WAIT_POLICY": "ACTIVE"}, False),
    (["polyrl", "train"], {"WORLD_SIZE": "1"}, True),
])
def test_which_commands_follow_the_load(argv, env, want):
    assert cpu_env.governable(env, argv) is want


@pytest.mark.parametrize("entry", ["python -m polyrl", "python -m polyrl.demo"])
def test_the_users_wait_setting_is_kept(entry, tmp_path):
    assert env_at_torch_import(entry, tmp_path, OMP_WAIT_POLICY="ACTIVE")["OMP_WAIT_POLICY"] == "ACTIVE"
    # GOMP_SPINCOUNT overrides the policy's spin count: the user chose the wait, no policy is added beside it
    assert env_at_torch_import(entry, tmp_path, GOMP_SPINCOUNT="1000") == {
        "OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "1000", "KMP_BLOCKTIME": None}


@pytest.mark.parametrize("threads, spin", [("2", "0"), (None, "300000")])
def test_torchs_openmp_runtime_runs_with_it(threads, spin):
    """libgomp itself reports the setting it read when torch loaded it (OMP_DISPLAY_ENV): no spinning at barriers
    with a fixed thread count, its own 300,000-turn spin in a command whose thread count follows the load."""
    base = {k: v for k, v in os.environ.items() if k not in WAIT and k != "POLYRL_CPU_THREADS"}
    out = subprocess.run([sys.executable, "-m", "polyrl", "eval"], capture_output=True, text=True, timeout=180,
                         env={**base, "OMP_DISPLAY_ENV": "VERBOSE", **({"POLYRL_CPU_THREADS": threads} if threads else {})})
    assert f"GOMP_SPINCOUNT = '{spin}'" in out.stderr, out.stderr[-3000:]
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
    assert "their count follows the machine's load" in text and "POLYRL_CPU_GOVERNOR=0" in text
