"""polyrl.dist's CPU thread count per rank: the cores split over the ranks unless POLYRL_CPU_THREADS says otherwise,
whatever OMP_NUM_THREADS holds (torchrun sets it to 1 for every multi-process job)."""

from __future__ import annotations

import pytest

from polyrl import dist as pdist
from polyrl.config import ConfigError


def test_ranks_split_the_cores_and_torchruns_omp_setting_does_not_count(monkeypatch):
    monkeypatch.delenv("POLYRL_CPU_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what torchrun exports to each process of a multi-process job
    monkeypatch.setattr(pdist.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert [pdist.cpu_threads(w) for w in (1, 2, 3, 16, 32)] == [16, 8, 5, 1, 1]


def test_the_cores_are_those_this_process_may_run_on_not_the_machines(monkeypatch):
    """A process pinned to 2 of 128 cores (taskset, a container's cpuset) runs 2 threads, not 128 on 2 cores."""
    monkeypatch.delenv("POLYRL_CPU_THREADS", raising=False)
    monkeypatch.setattr(pdist.os, "cpu_count", lambda: 128)
    monkeypatch.setattr(pdist.os, "sched_getaffinity", lambda pid: {5, 6})
    assert pdist.usable_cores() == pdist.cpu_threads(1) == 2


def test_polyrl_cpu_threads_sets_it(monkeypatch):
    monkeypatch.setattr(pdist.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("POLYRL_CPU_THREADS", "3")
    assert pdist.cpu_threads(1) == pdist.cpu_threads(4) == 3


@pytest.mark.parametrize("bad", ["0", "two", "-1", "1.5"])
def test_a_bad_polyrl_cpu_threads_is_refused_by_name(monkeypatch, bad):
    monkeypatch.setenv("POLYRL_CPU_THREADS", bad)
    with pytest.raises(ConfigError, match=f"POLYRL_CPU_THREADS={bad!r}"):
        pdist.cpu_threads(1)


def test_a_gpu_process_computes_its_host_work_on_one_thread_unless_its_optimizer_steps_on_the_cpu(monkeypatch):
    """A GPU rank's host tensors are small; a thread per core made OpenMP's barrier wait on parked threads (the reason
    is in host_threads). The CPU optimizers (--fsdp-cpu-offload, --optimizer-cpu-offload) get this host's share."""
    monkeypatch.delenv("POLYRL_CPU_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # 8 ranks over two hosts of 16 cores
    monkeypatch.setattr(pdist.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert pdist.host_threads("cuda", 8) == 1
    assert pdist.host_threads("cuda", 8, cpu_optimizer=True) == 4
    assert pdist.host_threads("cpu", 2) == pdist.cpu_threads(2) == 8
    monkeypatch.setenv("POLYRL_CPU_THREADS", "3")
    assert pdist.host_threads("cuda", 8) == pdist.host_threads("cuda", 8, cpu_optimizer=True) == 3


def test_setup_sets_the_host_threads_of_the_device(monkeypatch):
    import torch
    monkeypatch.delenv("POLYRL_CPU_THREADS", raising=False)
    monkeypatch.setattr(pdist.os, "sched_getaffinity", lambda pid: set(range(16)))
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr(pdist, "resolve_device", lambda d: d)
    monkeypatch.setattr(pdist, "init_distributed", lambda *a: None)
    monkeypatch.setattr(pdist.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(pdist.dist, "get_rank", lambda: 0)
    for device, cpu_opt in (("cuda", False), ("cuda", True), ("cpu", False)):
        pdist.setup(device, "auto", 0, 1.0, cpu_optimizer=cpu_opt)
    assert calls == [1, 8, 8]
