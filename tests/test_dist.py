"""polyrl.dist's CPU thread count per rank: the cores split over the ranks unless POLYRL_CPU_THREADS says otherwise,
whatever OMP_NUM_THREADS holds (torchrun sets it to 1 for every multi-process job)."""

from __future__ import annotations

import pytest

from polyrl import dist as pdist
from polyrl.config import ConfigError


def test_ranks_split_the_cores_and_torchruns_omp_setting_does_not_count(monkeypatch):
    monkeypatch.delenv("POLYRL_CPU_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what torchrun exports to each process of a multi-process job
    monkeypatch.setattr(pdist.os, "cpu_count", lambda: 16)
    assert [pdist.cpu_threads(w) for w in (1, 2, 3, 16, 32)] == [16, 8, 5, 1, 1]


def test_polyrl_cpu_threads_sets_it(monkeypatch):
    monkeypatch.setattr(pdist.os, "cpu_count", lambda: 16)
    monkeypatch.setenv("POLYRL_CPU_THREADS", "3")
    assert pdist.cpu_threads(1) == pdist.cpu_threads(4) == 3


@pytest.mark.parametrize("bad", ["0", "two", "-1", "1.5"])
def test_a_bad_polyrl_cpu_threads_is_refused_by_name(monkeypatch, bad):
    monkeypatch.setenv("POLYRL_CPU_THREADS", bad)
    with pytest.raises(ConfigError, match=f"POLYRL_CPU_THREADS={bad!r}"):
        pdist.cpu_threads(1)
