"""`polyrl serve` under hostile concurrent load (CPU, loopback, bounded in count and time): 8 clients x 25
requests mixing valid seeded requests with malformed JSON, oversized bodies, over-limit n and prompts, and
requests without the key. The server stays up, answers each kind as it must, gives every valid request
the tokens it gets when sent alone, and its RSS stays bounded. The load itself is bench/server_load.py's
(which runs it longer and prints latencies)."""

from __future__ import annotations

import importlib.util
import os

import pytest

pytestmark = pytest.mark.slow

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
CLIENTS, PER_CLIENT, NEW_TOKENS = 8, 25, 8
# The tiny model's largest batch under this load (8 clients x n=2 rows of < 20 tokens, 2 layers, hidden 64) holds
# well under 1 MiB of activations and KV cache, and the server keeps nothing of a request once answered; what may
# still grow is allocator and interpreter caches settling on new batch shapes (about 1-2 MiB measured). 16 MiB over
# 200 requests catches anything kept per request from about 80 KB up (an oversized body here is ~120 KB).
RSS_GROWTH_BOUND = 16 * 2**20


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
