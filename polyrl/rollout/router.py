"""The real sglang-router (`pip install sglang-router`, a Rust binary wheel) in front of engine
servers: launched as a subprocess on 127.0.0.1 and a free port, ready once it answers /readiness
and lists every worker, stopped with the job, and killed with the process that launched it, even
by kill -9 (`spawn`).

What the router asks of each worker (sglang-router 0.3.2, seen in front of `polyrl serve`): at
registration GET /health (no key), GET /server_info and GET /model_info (with the key); then
GET /health every --health-check-interval-secs; with --policy power_of_two, GET /get_load every
second (it reads {"load": int}). With --api-key it sends `Authorization: Bearer KEY` to the
workers and requires the same header from its own clients. Its key never appears on its command line
(readable by every local user): sglang-router takes it only as a flag, so the router runs through this
module's entry point, which reads it from POLYRL_API_KEY and hands it to sglang-router in-process.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import importlib.util
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from polyrl.dist import free_port

API_KEY_ENV = "POLYRL_API_KEY"
ROUTER_HINT = "--use-sglang-router needs the sglang-router package: pip install sglang-router (or pip install 'polyrl[sglang]')"


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL when the parent dies, even by kill -9 (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except OSError:  # not Linux: the caller's stop() and atexit still end it on a normal exit
        pass


_spawn_queue: queue.Queue | None = None
_spawn_lock = threading.Lock()


def spawn(cmd: list[str], **popen_kwargs) -> subprocess.Popen:
    """subprocess.Popen for a child that must die with this process, even by kill -9 (PR_SET_PDEATHSIG).
    The kernel sends that signal when the *thread* that started the child exits, not the process, so
    every such child is started from one daemon thread that lives as long as the process: a server
    (re)started from a short-lived thread would otherwise be killed the moment that thread ends."""
    global _spawn_queue
    with _spawn_lock:
        if _spawn_queue is None:
            _spawn_queue = queue.Queue()
            threading.Thread(target=_spawner, args=(_spawn_queue,), name="polyrl-spawner", daemon=True).start()
    fut: concurrent.futures.Future = concurrent.futures.Future()
    _spawn_queue.put((cmd, popen_kwargs, fut))
    return fut.result()


def _spawner(q: queue.Queue) -> None:
    while True:
        cmd, kw, fut = q.get()
        try:
            fut.set_result(subprocess.Popen(cmd, preexec_fn=_die_with_parent, **kw))
        except BaseException as e:  # handed to the caller
            fut.set_exception(e)


@dataclass
class Router:
    url: str
    proc: subprocess.Popen
    log_path: str

    @property
    def name(self) -> str:
        return f"sglang-router ({self.url}, log {self.log_path})"

    def tail(self, n: int = 20) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds; idempotent."""
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def launch_router(worker_urls: list[str], *, log_path: str, policy: str = "cache_aware", api_key: str | None = None,
                  timeout: float = 300.0, extra_args: tuple[str, ...] = (), port: int | None = None) -> Router:
    """Start sglang-router for `worker_urls` (which must already answer /health) on `port` (default: a free one) and
    wait, at most `timeout` seconds, until it routes to all of them. Raises RuntimeError naming the router and its
    log when it exits or is not ready in time (it is stopped then)."""
    if importlib.util.find_spec("sglang_router") is None:
        raise ImportError(ROUTER_HINT)
    port = port or free_port()
    cmd = [sys.executable, "-m", "polyrl.rollout.router", "--worker-urls", *worker_urls, "--policy", policy,
           "--host", "127.0.0.1", "--port", str(port),
           # its metrics endpoint defaults to 0.0.0.0:29000: loopback, and a port of its own per router
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
           "--worker-startup-timeout-secs", str(max(1, int(timeout))), "--worker-startup-check-interval", "1",
           *extra_args]
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    if api_key:
        env[API_KEY_ENV] = api_key
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    with os.fdopen(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
        proc = spawn(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                     start_new_session=True)  # Ctrl-C reaches the trainer, which stops it in order
    router = Router(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        _wait_ready(router, worker_urls, api_key, timeout)
    except BaseException:
        router.stop()
        raise
    return router


def _get(url: str, api_key: str | None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""


def _wait_ready(router: Router, worker_urls: list[str], api_key: str | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    want = {u.rstrip("/") for u in worker_urls}
    last = "no answer"
    while True:
        if router.proc.poll() is not None:
            raise RuntimeError(f"{router.name} exited with code {router.proc.returncode} while starting; last log "
                               f"lines:\n{router.tail()}")
        try:
            status, _ = _get(router.url + "/readiness", api_key)
            if status == 200:
                status, body = _get(router.url + "/workers", api_key)
                workers = json.loads(body).get("workers", []) if status == 200 else []
                listed = {w.get("url", "").rstrip("/") for w in workers if w.get("is_healthy", True)}
                if want <= listed:
                    return
                last = f"routes to {len(want & listed)} of {len(want)} workers"
            else:
                last = f"/readiness answered {status}"
        except (OSError, ValueError) as e:
            last = str(e)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{router.name} was not ready within {timeout:.0f} s ({last}); last log lines:\n"
                               f"{router.tail()}")
        time.sleep(0.2)


def main(argv: list[str]) -> None:
    """`python -m polyrl.rollout.router ARGS`: sglang-router's launch_router with ARGS, plus --api-key from
    POLYRL_API_KEY when set (so the key is in this process's memory, not its command line)."""
    from sglang_router.launch_router import launch_router as run_router, parse_router_args
    key = os.environ.pop(API_KEY_ENV, None)
    # one token, --api-key=KEY: a random key may begin with "-", which argparse would read as the next flag
    run_router(parse_router_args(list(argv) + ([f"--api-key={key}"] if key else [])))


if __name__ == "__main__":
    main(sys.argv[1:])
