"""Start the ranks of a multi-process test directly, with the environment torchrun gives its workers (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), and no torchrun agent between: the agent is one
more process that imports torch (about 3 s of CPU a launch on a 2-core machine) and adds nothing these tests check.
What the agent does that they rely on is kept: when one rank fails the others are stopped, the run is bounded in time,
and every process started is reaped. Tests of torchrun itself (its restarts, a run compared with one under the
agent) keep launching `torch.distributed.run`.

    res = run_ranks([script, *args], nproc=2, env=env, timeout=240)   # or ["-m", "polyrl", "train", ...]
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

from polyrl.dist import free_port

# a rank whose peers died is given this long to notice and exit before it is killed
_GRACE_S = 10.0


def _spawn(argv: list[str], nproc: int, env: dict, outdir: str) -> list[tuple[subprocess.Popen, object, object]]:
    port = free_port()
    procs = []
    for rank in range(nproc):
        renv = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        out = open(os.path.join(outdir, f"rank{rank}.out"), "w+")
        err = open(os.path.join(outdir, f"rank{rank}.err"), "w+")
        procs.append((subprocess.Popen([sys.executable, *argv], stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                       env=renv, start_new_session=True), out, err))
    return procs


def _kill(procs) -> None:
    for p, _, _ in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # the rank and anything it started: their own session
    for p, _, _ in procs:
        p.wait(timeout=30)


def _collect(argv, procs, code: int) -> subprocess.CompletedProcess:
    texts = []
    for _, out, err in procs:
        out.seek(0)
        err.seek(0)
        texts.append((out.read(), err.read()))
        out.close()
        err.close()
    return subprocess.CompletedProcess([sys.executable, *argv], code, "".join(t[0] for t in texts),
                                       "".join(t[1] for t in texts))


def _run_once(argv: list[str], nproc: int, env: dict, timeout: float) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="ranks_") as outdir:
        procs = _spawn(argv, nproc, env, outdir)
        deadline = time.monotonic() + timeout
        failed_at = None
        try:
            while any(p.poll() is None for p, _, _ in procs):
                now = time.monotonic()
                if failed_at is None and any(p.poll() not in (None, 0) for p, _, _ in procs):
                    failed_at = now
                if now > deadline or (failed_at is not None and now > failed_at + _GRACE_S):
                    break
                time.sleep(0.1)
            timed_out = any(p.poll() is None for p, _, _ in procs) and failed_at is None
        finally:
            _kill(procs)
        codes = [p.returncode for p, _, _ in procs]
        res = _collect(argv, procs, next((c for c in codes if c != 0), 0))
        if timed_out:
            raise subprocess.TimeoutExpired(res.args, timeout, output=res.stdout, stderr=res.stderr)
        return res


def run_ranks(argv: list[str], nproc: int, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python ARGV` as `nproc` ranks on this host (one plain process for nproc 1); returns as subprocess.run with
    capture_output does: the first failing rank's exit code (0 if none failed), each rank's stdout and stderr joined in
    rank order. Raises subprocess.TimeoutExpired past `timeout` seconds, every rank killed. The port rank 0 binds is
    free when chosen but may be taken before the bind (another test's process beside this one): such a start is
    made again on a fresh port, up to three times."""
    env = dict(os.environ if env is None else env)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    if nproc == 1:
        return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=timeout)
    for _ in range(3):
        res = _run_once(argv, nproc, env, timeout)
        if res.returncode == 0 or "EADDRINUSE" not in res.stderr and "address already in use" not in res.stderr:
            return res
    return res
