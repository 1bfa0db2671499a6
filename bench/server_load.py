"""`polyrl serve` under hostile load: C concurrent clients, each sending R requests, a fixed mix of
valid seeded /generate requests (3 of 8), malformed JSON, bodies over --max-request-bytes, requests
over --max-n or --max-prompts-per-request, and requests without the key (1 of 8 each). Every
valid request is first sent alone; under load it must get the same tokens (each prompt carries its
own sampling_seed, so batching cannot change them). Prints one table: per request kind the count,
p50 / p99 latency, and overall requests/s, plus the server's RSS before and after.

  python bench/server_load.py --device cpu --clients 8 --requests 200

A 429 (server full, --max-running-requests) is retried after its Retry-After like a real client;
any other unexpected answer, a wrong token, or a dead server fails the run (exit 1).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import selectors
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import build_model_dir, markdown_table  # noqa: E402

KEY = "bench-server-load-key"
KINDS = ("valid", "valid", "valid", "malformed", "oversized", "over_n", "over_prompts", "no_key")
# what each kind must get back
EXPECT = {"valid": 200, "malformed": 400, "oversized": 413, "over_n": 400, "over_prompts": 400, "no_key": 401}
# server limits the load runs against (small, so every over-limit kind is cheap to build)
SERVER_ARGS = ("--max-request-bytes", "65536", "--max-n", "4", "--max-prompts-per-request", "4",
               "--max-running-requests", "256", "--batch-wait-ms", "2")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/server_load.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=200, help="requests per client")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--timeout", type=float, default=600.0, help="the whole load phase must end within this (s)")
    p.add_argument("--model-dir", default=None, help="reuse a model directory (default: the tiny model, fresh)")
    return p.parse_args(argv)


def request(c: int, k: int, new_tokens: int) -> tuple[str, bytes, dict]:
    """(kind, body, headers) of client c's k-th request: a pure function, so the reference pass can rebuild it."""
    kind = KINDS[(c + k) % len(KINDS)]
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    prompt = [3 + (c + k) % 9, 12, 4 + k % 7, 13]
    sp = {"max_new_tokens": new_tokens, "temperature": 1.0, "n": 2, "sampling_seed": 1000 * c + k}
    if kind == "malformed":
        return kind, b'{"input_ids": [1, 2', headers
    if kind == "oversized":
        return kind, json.dumps({"input_ids": [1] * 40000}).encode(), headers  # ~120 KB, over 64 KiB
    if kind == "over_n":
        return kind, json.dumps({"input_ids": prompt, "sampling_params": {**sp, "n": 5}}).encode(), headers
    if kind == "over_prompts":
        return kind, json.dumps({"input_ids": [prompt] * 5, "sampling_params": sp}).encode(), headers
    if kind == "no_key":
        headers = {"Content-Type": "application/json"}
    return kind, json.dumps({"input_ids": prompt, "sampling_params": sp}).encode(), headers


def send(url: str, body: bytes, headers: dict, timeout: float = 60.0) -> tuple[int, bytes, dict]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", "/generate", body=body, headers=headers)
        r = conn.getresponse()
        return r.status, r.read(), dict(r.getheaders())
    except (ConnectionError, http.client.HTTPException) as e:  # a server may close early on an oversized body
        return -1, str(e).encode(), {}
    finally:
        conn.close()


def tokens(body: bytes) -> list[list[int]]:
    out = json.loads(body)
    return [o["output_ids"] for o in (out if isinstance(out, list) else [out])]


def reference(url: str, clients: int, per_client: int, new_tokens: int) -> dict[tuple[int, int], list[list[int]]]:
    """Every valid request sent alone, one at a time: the tokens each must get under load."""
    ref = {}
    for c in range(clients):
        for k in range(per_client):
            kind, body, headers = request(c, k, new_tokens)
            if kind == "valid":
                status, answer, _ = send(url, body, headers)
                if status != 200:
                    raise RuntimeError(f"reference request ({c}, {k}) got HTTP {status}: {answer[:200]!r}")
                ref[(c, k)] = tokens(answer)
    return ref


def run_load(url: str, clients: int, per_client: int, new_tokens: int, ref: dict, timeout: float) -> dict:
    """The load phase: per kind the latencies, and every failure (unexpected status, wrong tokens) as text."""
    lat: dict[str, list[float]] = {k: [] for k in EXPECT}
    failures: list[str] = []
    retries = [0]
    lock = threading.Lock()
    deadline = time.monotonic() + timeout

    def client(c: int) -> None:
        for k in range(per_client):
            if time.monotonic() > deadline:
                with lock:
                    failures.append(f"client {c}: out of time at request {k}")
                return
            kind, body, headers = request(c, k, new_tokens)
            t0 = time.perf_counter()
            while True:
                status, answer, h = send(url, body, headers)
                if status != 429 or time.monotonic() > deadline:
                    break
                with lock:
                    retries[0] += 1
                time.sleep(min(1.0, float(h.get("Retry-After", "1"))))
            dt = time.perf_counter() - t0
            ok = status == EXPECT[kind] or (kind == "oversized" and status == -1)
            if ok and kind == "valid" and tokens(answer) != ref[(c, k)]:
                ok = False
                answer = b"tokens differ from the request sent alone"
            with lock:
                lat[kind].append(dt)
                if not ok:
                    failures.append(f"client {c} request {k} ({kind}): HTTP {status}: {answer[:200]!r}")

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + 5)
    wall = time.perf_counter() - t0
    if any(t.is_alive() for t in threads):
        failures.append(f"clients still running after --timeout {timeout:g} s")
    return {"latencies": lat, "failures": failures, "wall_s": wall, "retries_429": retries[0],
            "requests": sum(len(v) for v in lat.values())}


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def table(res: dict) -> str:
    rows = [[k, len(v), f"{1e3 * pct(v, 0.5):.1f}", f"{1e3 * pct(v, 0.99):.1f}"] for k, v in res["latencies"].items()]
    allv = [x for v in res["latencies"].values() for x in v]
    rows.append(["all", len(allv), f"{1e3 * pct(allv, 0.5):.1f}", f"{1e3 * pct(allv, 0.99):.1f}"])
    return (markdown_table(["kind", "requests", "p50 ms", "p99 ms"], rows)
            + f"\n\n{res['requests']} requests in {res['wall_s']:.1f} s: {res['requests'] / res['wall_s']:.1f} requests/s; "
              f"429 retries {res['retries_429']}; failures {len(res['failures'])}")


class Server:
    """`polyrl serve` in a subprocess on a free loopback port, its key in its environment."""

    def __init__(self, model: str, device: str, log_path: str, *args: str):
        env = {**os.environ, "POLYRL_API_KEY": KEY, "OMP_NUM_THREADS": "1"}
        self.log_path = log_path
        self.proc = subprocess.Popen([sys.executable, "-m", "polyrl", "serve", "--hf-checkpoint", model, "--device", device,
                                      "--port", "0", *args], stdout=subprocess.PIPE, stderr=open(log_path, "wb"),
                                     stdin=subprocess.DEVNULL, env=env)
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and self.proc.poll() is None:
            if sel.select(timeout=0.5):
                line = self.proc.stdout.readline()
                if line.startswith(b"polyrl serve: listening on "):
                    self.url = line.decode().split()[-1]
                    return
        self.stop()
        raise RuntimeError(f"polyrl serve did not start within 300 s; log:\n{open(log_path).read()[-3000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc.stdout.close()
        return self.proc.returncode


def main(argv=None) -> int:
    a = parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="polyrl_bench_load_")
    model = a.model_dir
    if model is None:
        model = os.path.join(tmp, "model")
        build_model_dir(model, "tiny")
    srv = Server(model, a.device, os.path.join(tmp, "serve.log"), *SERVER_ARGS)
    try:
        ref = reference(srv.url, a.clients, a.requests, a.new_tokens)
        rss0 = rss_bytes(srv.proc.pid)
        res = run_load(srv.url, a.clients, a.requests, a.new_tokens, ref, a.timeout)
        rss1 = rss_bytes(srv.proc.pid)
        alive = srv.proc.poll() is None
    finally:
        code = srv.stop()
    print(table(res))
    print(f"server RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB; alive through the load: {alive}; exit code {code}")
    for f in res["failures"][:20]:
        print("FAIL", f)
    return 0 if alive and not res["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
