"""`polyrl serve` subprocesses for tests: started on a free loopback port, stopped (and reaped) by
the caller; every wait bounded."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from contextlib import contextmanager


class ServeProc:
    def __init__(self, model: str, log_path: str, *args: str, device: str = "cpu", gpu: int | None = None):
        """gpu: the one CUDA device the server sees (CUDA_VISIBLE_DEVICES)."""
        self.log_path = log_path
        env = {**os.environ, "OMP_NUM_THREADS": "1", **({"CUDA_VISIBLE_DEVICES": str(gpu)} if gpu is not None else {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "polyrl", "serve", "--hf-checkpoint", model, "--device", device, "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=open(log_path, "wb"), stdin=subprocess.DEVNULL, env=env)
        self.url = ""

    def ready(self, timeout: float = 120.0) -> "ServeProc":
        """Wait for the start-up line and take the URL from it."""
        self.url = self._read_url(timeout)
        return self

    def _read_url(self, timeout: float) -> str:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        line = b""
        while time.monotonic() < deadline:
            if sel.select(timeout=0.5):
                line = self.proc.stdout.readline()
                if line.startswith(b"polyrl serve: listening on "):
                    return line.decode().split()[-1]
                if not line and self.proc.poll() is not None:
                    break
        self.stop()
        raise RuntimeError(f"polyrl serve did not start (last line {line!r}); log:\n{open(self.log_path).read()[-3000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc.stdout.close()
        return self.proc.returncode


@contextmanager
def serving(model: str, tmp_path, n: int = 1, *args: str):
    """n servers, started at once; stopped whatever happens."""
    procs: list[ServeProc] = []
    try:
        for k in range(n):
            procs.append(ServeProc(model, str(tmp_path / f"serve{k}.log"), *args))
        yield [p.ready() for p in procs]
    finally:
        for p in procs:
            p.stop()
