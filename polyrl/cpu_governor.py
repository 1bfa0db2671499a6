"""The CPU thread count of a single-process CPU run, following the machine's load while it runs.

OpenMP threads that spin at barriers are the fastest on free cores and collapse beside another busy process (a
spinning thread takes the time slice the thread it waits for needs); threads that sleep at once are safe beside one
and cost every barrier a wake-up on an idle machine (bench/RESULTS.md#cpu-contention). libgomp reads its wait policy
once, at start-up, so a process cannot switch it; it can switch its thread count. A process that polyrl.cpu_env
leaves spinning (GOVERNED: one rank, polyrl choosing the threads) runs a Governor: a thread reads /proc every
INTERVAL_S and works out how many of this process's cores other work keeps busy (their busy time minus this
process's own), and the compute thread takes the count at its next tick() (a phase, a micro-batch, a decode step):
every core while the others are free, fewer while something else computes, one when the cores are taken. One thread
runs its parallel regions alone, so nothing spins where another process needs the core.
"""

from __future__ import annotations

import math
import os
import threading

INTERVAL_S = 0.25  # how often the load is read: a busy neighbour costs at most about this long at full spin
MARGIN = 0.45  # cores: other work this far under a whole core leaves that core to this process (noise, a daemon)
UP_AFTER = 2  # readings in a row that allow more threads before the count goes up (none to go down)

_GOVERNOR: "Governor | None" = None


def threads_for(others_busy: float, cores: int, most: int) -> int:
    """The thread count when other work keeps `others_busy` of this process's `cores` busy (at most `most`)."""
    return max(1, min(most, math.floor(cores - others_busy + MARGIN)))


def read_cpu_jiffies(cpus: set[int], text: str) -> tuple[int, int]:
    """(busy, total) clock ticks of /proc/stat's per-CPU lines for `cpus`: busy is everything but idle and iowait."""
    busy = total = 0
    for line in text.splitlines():
        name, *vals = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        v = [int(x) for x in vals[:8]] + [0] * (8 - len(vals[:8]))
        idle = v[3] + v[4]
        busy += sum(v) - idle
        total += sum(v)
    return busy, total


def read_own_jiffies(text: str) -> int:
    """utime + stime of /proc/self/stat (every thread of this process), in clock ticks."""
    fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces; fields after it from state on
    return int(fields[11]) + int(fields[12])


class Governor:
    def __init__(self, most: int, *, interval: float = INTERVAL_S, proc: str = "/proc"):
        self.cpus = set(os.sched_getaffinity(0))
        self.most, self.interval, self.proc = most, interval, proc
        self.target = self.applied = most
        self.owner = threading.get_ident()  # the compute thread: torch's thread count is a per-thread OpenMP setting
        self.changes = 0
        self._ups = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="polyrl-cpu-governor", daemon=True)

    def _read(self) -> tuple[int, int, int]:
        with open(os.path.join(self.proc, "stat")) as f:
            busy, total = read_cpu_jiffies(self.cpus, f.read())
        with open(os.path.join(self.proc, "self", "stat")) as f:
            own = read_own_jiffies(f.read())
        return busy, total, own

    def observe(self, others_busy: float) -> int:
        """A reading of the others' load: the new target (down at once, up after UP_AFTER readings in a row)."""
        want = threads_for(others_busy, len(self.cpus), self.most)
        if want < self.target:
            self.target, self._ups = want, 0
        elif want > self.target:
            self._ups += 1
            if self._ups >= UP_AFTER:
                self.target, self._ups = want, 0
        else:
            self._ups = 0
        return self.target

    def _run(self) -> None:
        try:
            prev = self._read()
            while not self._stop.wait(self.interval):
                try:
                    cur = self._read()
                except (ValueError, IndexError):  # a line it cannot parse: this reading is skipped
                    continue
                busy, total, own = (c - p for c, p in zip(cur, prev))
                prev = cur
                if total > 0:
                    per_cpu = total / len(self.cpus)  # ticks each CPU had in the interval
                    self.observe(max(0.0, busy - own) / per_cpu)
        except (OSError, ValueError, IndexError):  # no /proc, or not one it can read: the count stays where it is
            return

    def start(self) -> "Governor":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()


def start(most: int) -> Governor | None:
    """Start this process's governor (at most `most` threads) if it has none and /proc is there; returns it."""
    global _GOVERNOR
    if _GOVERNOR is None and os.path.exists("/proc/self/stat") and hasattr(os, "sched_getaffinity"):
        _GOVERNOR = Governor(most).start()
    return _GOVERNOR


def stop() -> None:
    """Stop the governor, the thread count back at what it started from."""
    global _GOVERNOR
    g, _GOVERNOR = _GOVERNOR, None
    if g is not None:
        g.stop()
        if g.applied != g.most and threading.get_ident() == g.owner:
            import torch
            torch.set_num_threads(g.most)


def metrics() -> dict[str, float]:
    """The step's row: the thread count now and how often it changed since the last call (a governed run only)."""
    g = _GOVERNOR
    if g is None:
        return {}
    changes, g.changes = g.changes, 0
    return {"cpu/threads": float(g.applied), "cpu/thread_changes": float(changes)}


def tick() -> None:
    """On the compute thread, between pieces of work: take the governor's thread count if it changed."""
    g = _GOVERNOR
    if g is None or g.target == g.applied or threading.get_ident() != g.owner:
        return
    import torch
    n = g.target
    torch.set_num_threads(n)
    g.applied, g.changes = n, g.changes + 1
