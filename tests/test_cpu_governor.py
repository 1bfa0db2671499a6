"""polyrl.cpu_governor: the thread count a single-process CPU run takes from the machine's load, read from /proc (a
fake one here, so that the load is the test's), applied on the compute thread only, and reported in the step's row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from polyrl import cpu_governor as cg


def test_the_count_leaves_the_others_their_cores():
    assert cg.threads_for(0.0, 2, 2) == 2 and cg.threads_for(0.3, 2, 2) == 2  # idle, or a daemon's noise
    assert cg.threads_for(0.67, 2, 2) == 1  # one busy process beside two spinning threads gets about 2/3 of a core
    assert cg.threads_for(1.0, 2, 2) == 1 and cg.threads_for(5.0, 2, 2) == 1  # never fewer than one
    assert cg.threads_for(3.0, 16, 16) == 13 and cg.threads_for(0.0, 16, 8) == 8  # at most what the run would take


def test_proc_files_are_read_for_this_processs_cpus_and_threads():
    stat = ("cpu  900 0 300 5000 100 0 0 0 0 0\n"
            "cpu0 400 0 100 2000 50 0 0 0 0 0\n"
            "cpu1 500 0 200 3000 50 0 0 0 0 0\n"
            "cpu2 999 0 0 0 0 0 0 0 0 0\nintr 1 2 3\n")
    assert cg.read_cpu_jiffies({0, 1}, stat) == (1200, 6300)  # busy: all but idle and iowait; cpu2 is not ours
    own = "4242 (python (x) y) R 1 2 3 4 5 6 7 8 9 10 123 45 0 0 20 0 9 0 100\n"  # a name with spaces and parens
    assert cg.read_own_jiffies(own) == 168


def test_down_at_once_up_after_two_readings():
    g = cg.Governor(2)
    g.cpus = {0, 1}
    assert g.observe(1.0) == 1  # a busy neighbour: one thread at the next tick
    assert g.observe(0.0) == 1  # free again: not yet
    assert g.observe(0.0) == 2
    assert g.observe(0.0) == 2 and g.observe(0.8) == 1


class FakeProc:
    """A /proc whose CPUs (this process's) advance 100 ticks each per round, split between this process, other work
    and idle time."""

    def __init__(self, root, cpus: set[int]):
        self.root, self.cpus, self.busy, self.own, self.idle = root, sorted(cpus), 0, 0, 0
        (root / "self").mkdir()
        self.write()

    def write(self) -> None:
        n = len(self.cpus)
        lines = [f"cpu{c} {self.busy // n} 0 0 {self.idle // n} 0 0 0 0 0 0" for c in self.cpus]
        for path, text in ((self.root / "stat", "cpu  0 0 0 0 0 0 0 0 0 0\n" + "\n".join(lines) + "\n"),
                           (self.root / "self" / "stat", f"1 (python) R 1 1 1 0 0 0 0 0 0 0 {self.own} 0 0 0 20 0 1 0 1\n")):
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            os.replace(tmp, path)  # whole, as /proc's files are read

    def round(self, own_cores: float, other_cores: float) -> None:
        n = len(self.cpus)
        own, other = int(100 * own_cores), int(100 * other_cores)
        self.own, self.busy, self.idle = self.own + own, self.busy + own + other, self.idle + 100 * n - own - other
        self.write()


def test_the_reading_thread_follows_a_neighbour_that_comes_and_goes(tmp_path):
    cpus = set(os.sched_getaffinity(0))
    n = len(cpus)
    proc = FakeProc(tmp_path, cpus)
    g = cg.Governor(n, interval=0.01, proc=str(tmp_path)).start()

    def until(want: int, own: float, other: float) -> int:
        deadline = time.monotonic() + 20  # rounds every 20 ms; the governor reads every 10 ms
        while g.target != want and time.monotonic() < deadline:
            proc.round(own, other)
            time.sleep(0.02)
        return g.target
    try:
        assert until(max(1, n - 1), n - 1.0, 1.0) == max(1, n - 1)  # another process computes on one core
        assert until(n, float(n), 0.0) == n  # it stopped: every core again
    finally:
        g.stop()


def test_the_count_is_taken_on_the_compute_thread_only(monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    g = cg.Governor(2)
    monkeypatch.setattr(cg, "_GOVERNOR", g)
    g.target = 1
    t = threading.Thread(target=cg.tick)  # another thread (a scorer, the gateway): its count is not the compute's
    t.start()
    t.join(10)
    assert g.applied == 2 and torch.get_num_threads() == 2
    try:
        cg.tick()
        assert g.applied == 1 and torch.get_num_threads() == 1
        assert cg.metrics() == {"cpu/threads": 1.0, "cpu/thread_changes": 1.0}
        assert cg.metrics()["cpu/thread_changes"] == 0.0
    finally:
        torch.set_num_threads(before)


def test_a_cpu_run_on_its_own_follows_the_load_and_logs_its_thread_count(tiny_model, arith_data, tmp_path):
    """`polyrl train` on the CPU as a user runs it (no POLYRL_CPU_THREADS): its rows carry the thread count it ran
    with."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("POLYRL_CPU_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_NUM_THREADS")}
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "polyrl", "train", "--hf-checkpoint", tiny_model, "--prompt-data",
                          arith_data["train"], "--rm-type", "arithmetic", "--rollout-batch-size", "2",
                          "--n-samples-per-prompt", "2", "--rollout-max-response-len", "3", "--num-rollout", "2",
                          "--device", "cpu", "--quiet", "--run-dir", str(run)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    cores = len(os.sched_getaffinity(0))
    assert len(rows) == 2 and all(1 <= r["cpu/threads"] <= cores and "cpu/thread_changes" in r for r in rows), rows


def test_what_a_governed_process_starts_waits_passively():
    """The process itself loaded OpenMP spinning; the servers, ranks and workers it starts inherit the passive wait."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("POLYRL_CPU_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    code = ("import os, sys; sys.argv = ['polyrl', 'train']; from polyrl import cpu_env; cpu_env.start_process(); "
            "print(cpu_env.GOVERNED, 'torch' in sys.modules, os.environ.get('OMP_WAIT_POLICY'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "True", "PASSIVE"], out.stdout + out.stderr
