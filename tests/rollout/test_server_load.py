"""`polyrl serve` under hostile concurrent load (CPU, loopback, bounded in count and time): 8 clients x 25
requests mixing valid seeded requests with malformed JSON, oversized bodies, over-limit n and prompts, and
requests without the key. The server stays up, answers each kind as it must, gives every valid request
the tokens it gets when sent alone, and its RSS stays bounded. The load itself is bench/server_load.py's
(which runs it longer and prints latencies)."""

from __future__ import annotations

import concurrent.futures
import http.client
import importlib.util
import json
import os
import sys
import threading

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from serve_procs import ServeProc  # noqa: E402

pytestmark = pytest.mark.slow

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
CLIENTS, PER_CLIENT, NEW_TOKENS = 8, 25, 8
# The tiny model's largest batch under this load (8 clients x n=2 rows of < 20 tokens, 2 layers, hidden 64) holds
# well under 1 MiB of activations and KV cache, and the server keeps nothing of a request once answered; what may
# still grow is allocator and interpreter caches settling on new batch shapes (about 1-2 MiB measured). 16 MiB over
# 200 requests catches anything kept per request from about 80 KB up (an oversized body here is ~120 KB).
RSS_GROWTH_BOUND = 16 * 2**20


# What a 50 MB text request may leave in the server: its body and the decoded string (~100 MB each, twice at once) and
# the allocator's keep of them; tokenizing one would take ~6 GB (~120 bytes a character)
TEXT_RSS_BOUND = 1 << 30


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_server_load", os.path.join(BENCH, "server_load.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_hostile_concurrent_load_gets_the_right_answers_and_the_same_tokens(tiny_model, tmp_path):
    bench = load_bench()
    srv = bench.Server(tiny_model, "cpu", str(tmp_path / "serve.log"), *bench.SERVER_ARGS)
    try:
        ref = bench.reference(srv.url, CLIENTS, PER_CLIENT, NEW_TOKENS)  # every valid request alone; also the warm-up
        assert len(ref) == 75
        rss0 = bench.rss_bytes(srv.proc.pid)
        res = bench.run_load(srv.url, CLIENTS, PER_CLIENT, NEW_TOKENS, ref, timeout=300)
        assert srv.proc.poll() is None, "the server died under load"
        rss1 = bench.rss_bytes(srv.proc.pid)
    finally:
        srv.stop()
    assert res["failures"] == [], res["failures"][:10]
    assert res["requests"] == CLIENTS * PER_CLIENT
    assert {k: len(v) for k, v in res["latencies"].items()} == {
        "valid": 75, "malformed": 25, "oversized": 25, "over_n": 25, "over_prompts": 25, "no_key": 25}
    assert rss1 - rss0 < RSS_GROWTH_BOUND, f"server RSS grew {(rss1 - rss0) / 2**20:.1f} MiB over the load"


def health(url: str, timeout: float) -> int | str:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    except OSError as e:  # a timeout: the event loop is blocked
        return f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def test_50_mb_of_text_is_refused_before_tokenizing_while_health_keeps_answering(tiny_model, tmp_path):
    """Two /generate bodies of 50 MB of "text" at once (under the 64 MiB --max-request-bytes default) and a 1 MB single
    prompt, while /health is polled with a short timeout: each is refused before it is tokenized (--max-text-chars; the
    context), every poll answers, and the server's RSS stays far below what tokenizing them would take."""
    bench = load_bench()
    srv = ServeProc(tiny_model, str(tmp_path / "serve.log")).ready()
    polls: list = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            polls.append(health(srv.url, timeout=5))
            stop.wait(0.05)

    headers = {"Content-Type": "application/json"}
    big = json.dumps({"text": "1+2=" * (50_000_000 // 4), "sampling_params": {"max_new_tokens": 2}}).encode()
    long_one = json.dumps({"text": "1" * 1_000_000}).encode()
    try:
        rss0 = bench.rss_bytes(srv.proc.pid)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            poller = pool.submit(poll)
            answers = list(pool.map(lambda b: bench.send(srv.url, b, headers, timeout=120), [big, big, long_one]))
            stop.set()
            poller.result()
        polls.append(health(srv.url, timeout=5))
        rss1 = bench.rss_bytes(srv.proc.pid)
        assert srv.proc.poll() is None, "the server died"
    finally:
        srv.stop()
    assert [a[0] for a in answers] == [400, 400, 400], [a[:2] for a in answers]
    assert b"50000000 characters; at most --max-text-chars 4194304" in answers[0][1], answers[0][1]
    assert b"1000000 characters, more than the model's context of 64 tokens" in answers[2][1], answers[2][1]
    assert len(polls) >= 2 and all(p == 200 for p in polls), polls
    assert rss1 - rss0 < TEXT_RSS_BOUND, f"server RSS grew {(rss1 - rss0) / 2**20:.0f} MiB"
