"""`polyrl serve` on CPU, loopback only: SGLang's payload shapes, samples equal to the embedded
engine's with the same prompt seeds, batching of concurrent requests, every endpoint, bad requests
answered with 4xx while the server keeps serving, the CLI, and the real sglang-router in front.
Servers run in this process (an event loop in a thread) except for the CLI test; each is started
and stopped by its test or fixture; every request is bounded in time."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from polyrl.config import ServerConfig
from polyrl.rollout.embedded import EmbeddedEngine, make_embedded_engine
from polyrl.rollout.http_client import EngineHTTPError, HTTPClient
from polyrl.rollout.server import ServerThread
from polyrl.types import SamplingParams
from polyrl.weight_sync.distributed import decode_tensor

KEY = "test-key"
# Same FP32 model on both sides; batch composition (left padding, rows leaving the batch) changes BLAS
# reduction order only: logprobs agree to ~1e-6, 1e-4 leaves two orders of magnitude
LOGPROB_TOL = 1e-4


class CountingEngine(EmbeddedEngine):
    """The embedded engine, counting generate calls and the prompts in each."""

    def generate(self, prompts, params, should_stop=None, **kw):
        self.calls.append(len(prompts))
        return super().generate(prompts, params, should_stop, **kw)


def wait_for(cond, what: str, timeout: float = 30.0) -> None:
    """Poll a server-side state (queue lengths, counters) until it holds; the timeout only bounds a failure."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def srv(tiny_model, tmp_path_factory):
    eng = CountingEngine(tiny_model, dtype=torch.float32)
    eng.calls = []
    weights = tmp_path_factory.mktemp("allowed_weights")
    st = ServerThread(eng, ServerConfig(port=0, api_key=KEY, max_request_bytes=1 << 20, batch_wait_ms=5,
                                        allowed_weight_dirs=[str(weights)]),
                      model_path=tiny_model, seed=0)
    http = HTTPClient(api_key=KEY)
    st.http, st.engine, st.weights_dir = http, eng, weights
    try:
        yield st
    finally:
        http.close()
        st.stop()


@pytest.fixture(scope="module")
def ref(tiny_model):
    return EmbeddedEngine(tiny_model, dtype=torch.float32)


def call(st, path: str, payload: dict | None = None, method: str | None = None):
    return st.http.call(st.url, path, payload, method=method, timeout=30)


def raw(st, path: str, body: bytes | None = None, headers: dict | None = None, method: str = "POST") -> tuple[int, str]:
    """One request with exactly these bytes and headers."""
    host, port = st.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body, headers={"Authorization": f"Bearer {KEY}", **(headers or {})})
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace")
    finally:
        conn.close()


def prompts(tok, k: int) -> list[list[int]]:
    return [tok(f"{a}+{a * 7 % 50}=")["input_ids"] for a in range(k)]


# ---- payload shapes --------------------------------------------------------------------------------
def test_single_batch_and_n_payload_shapes(srv):
    sp = {"max_new_tokens": 4, "temperature": 1.0, "sampling_seed": 7}
    one = call(srv, "/generate", {"input_ids": [5, 6, 7], "sampling_params": sp, "return_logprob": True, "rid": "r1"})
    assert isinstance(one, dict) and set(one) == {"text", "output_ids", "meta_info"}
    mi = one["meta_info"]
    assert mi["id"] == "r1" and mi["prompt_tokens"] == 3 and mi["completion_tokens"] == len(one["output_ids"])
    assert mi["weight_version"] == "0" and mi["e2e_latency"] > 0 and mi["cached_tokens"] == 0
    assert mi["finish_reason"]["type"] in ("stop", "length")
    assert [t for _, t, _ in mi["output_token_logprobs"]] == one["output_ids"]
    assert all(x is None and lp <= 0 for lp, _, x in mi["output_token_logprobs"])
    assert "output_token_logprobs" not in call(srv, "/generate", {"input_ids": [5, 6, 7], "sampling_params": sp})["meta_info"]

    n3 = call(srv, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {**sp, "n": 3}})
    assert isinstance(n3, list) and len(n3) == 3
    assert n3[0]["output_ids"] == one["output_ids"]  # sample 0 of seed s is the n=1 sample of seed s

    batch = call(srv, "/generate", {"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": sp, "rid": "b"})
    assert isinstance(batch, list) and len(batch) == 2
    assert [o["meta_info"]["id"] for o in batch] == ["b_0", "b_1"] and batch[0]["output_ids"] == one["output_ids"]
    # n > 1 with a batch: one flat list, prompt-major (SGLang's order), sampling_params may be one per prompt
    bn = call(srv, "/generate", {"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": [{**sp, "n": 3}, {**sp, "n": 3}]})
    assert len(bn) == 6 and [o["meta_info"]["prompt_tokens"] for o in bn] == [3, 3, 3, 2, 2, 2]
    assert [o["output_ids"] for o in bn[:3]] == [o["output_ids"] for o in n3]

    text = call(srv, "/generate", {"text": "1+2=", "sampling_params": sp, "return_logprob": True,
                                   "return_text_in_logprobs": True})
    assert isinstance(text["meta_info"]["output_token_logprobs"][0][2], str)
    texts = call(srv, "/generate", {"text": ["1+2=", "3+4="], "sampling_params": sp})
    assert len(texts) == 2 and all(isinstance(o["text"], str) for o in texts)
    # top_logprobs_num: per output token, SGLang's [[logprob, token id, text or null], ...], likeliest first; one per
    # prompt of a batch; the same tokens as without it
    top = call(srv, "/generate", {"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": sp, "return_logprob": True,
                                  "top_logprobs_num": [3, 0], "return_text_in_logprobs": True})
    assert top[0]["output_ids"] == one["output_ids"] and "output_top_logprobs" not in top[1]["meta_info"]
    alts = top[0]["meta_info"]["output_top_logprobs"]
    assert len(alts) == len(one["output_ids"]) and all(len(pos) == 3 for pos in alts)
    for pos in alts:
        assert [lp for lp, _, _ in pos] == sorted((lp for lp, _, _ in pos), reverse=True)
        assert all(isinstance(t, int) and isinstance(x, str) for _, t, x in pos)


def test_an_engine_without_top_alternatives_refuses_them_by_name(tiny_model):
    """The GPU engine reports the sampled token's log-prob only: its server answers 400 naming the field, before
    anything is queued."""
    eng = EmbeddedEngine(tiny_model, dtype=torch.float32)
    eng.reports_top_logprobs = False
    st = ServerThread(eng, ServerConfig(port=0, api_key=KEY), model_path=tiny_model, seed=0)
    http = HTTPClient(api_key=KEY)
    try:
        with pytest.raises(EngineHTTPError, match="top_logprobs_num.*sampled token's log-prob only"):
            http.call(st.url, "/generate", {"input_ids": [5, 6], "return_logprob": True, "top_logprobs_num": 2}, timeout=30)
        assert http.call(st.url, "/generate", {"input_ids": [5, 6], "return_logprob": True}, timeout=30)["output_ids"]
    finally:
        http.close()
        st.stop()


@pytest.mark.parametrize("sp", [
    SamplingParams(temperature=1.0, max_new_tokens=8, n=3),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=8, n=2),
    SamplingParams(temperature=0.0, max_new_tokens=6, n=1),
    SamplingParams(temperature=1.0, max_new_tokens=10, n=2, stop=["1"], stop_token_ids=[5]),
], ids=["sampled", "topk-topp", "greedy", "stops"])
def test_generate_equals_the_embedded_engine_with_the_same_prompt_seeds(srv, ref, sp):
    ps = prompts(ref.tokenizer, 6)
    seeds = [1000 + 17 * i for i in range(len(ps))]
    want = ref.generate(ps, SamplingParams(**{**sp.__dict__, "prompt_seeds": seeds}))
    body = lambda i: {"input_ids": ps[i], "return_logprob": True, "sampling_params": {  # noqa: E731
        "temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k, "max_new_tokens": sp.max_new_tokens,
        "stop": sp.stop, "stop_token_ids": sp.stop_token_ids, "n": sp.n, "sampling_seed": seeds[i]}}
    futs = [srv.http.call_async(srv.url, "/generate", body(i), timeout=60) for i in range(len(ps))]  # one request per prompt
    got = [o for f in futs for o in (lambda r: r if isinstance(r, list) else [r])(f.result(65))]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g["output_ids"] == w.response_ids
        assert max(abs(a[0] - b) for a, b in zip(g["meta_info"]["output_token_logprobs"], w.rollout_logprobs)) < LOGPROB_TOL
        fr = g["meta_info"]["finish_reason"]
        assert fr["type"] == w.finish_reason
        if fr["type"] == "length":
            assert fr["length"] == sp.max_new_tokens and g["text"] == w.response
        elif isinstance(fr["matched"], int):  # a stop token: the last id, left out of the text
            assert fr["matched"] == w.response_ids[-1] and fr["matched"] in [*sp.stop_token_ids, ref.tokenizer.eos_token_id]
        else:  # a stop string: the text ends before it
            assert fr["matched"] in sp.stop and w.response.startswith(g["text"]) and fr["matched"] not in g["text"]


def test_concurrent_requests_are_batched(srv, ref):
    ps = prompts(ref.tokenizer, 32)
    call(srv, "/pause_generation", {"mode": "in_place"})  # the 32 requests queue while paused, whatever their timing
    srv.engine.calls.clear()
    futs = [srv.http.call_async(srv.url, "/generate", {"input_ids": p, "sampling_params": {
        "max_new_tokens": 6, "sampling_seed": i}}, timeout=60) for i, p in enumerate(ps)]
    wait_for(lambda: len(srv.server._pending) == 32, "32 queued prompts")
    call(srv, "/continue_generation", {})
    outs = [f.result(65) for f in futs]
    assert len(outs) == 32 and srv.engine.calls == [32]  # one sampling setting: one engine call for all of them
    # and a request with the same seed gives the same tokens whatever batch it lands in
    alone = call(srv, "/generate", {"input_ids": ps[3], "sampling_params": {"max_new_tokens": 6, "sampling_seed": 3}})
    assert alone["output_ids"] == outs[3]["output_ids"]


# ---- bad requests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("body,headers,status,msg", [
    (b'{"input_ids": [1, 2', None, 400, "malformed JSON"),
    (b"[1, 2, 3]", None, 400, "JSON object"),
    (b"[" * 100000, None, 400, "malformed JSON"),
    (b'{"input_ids": ["a", "b"]}', None, 400, "input_ids"),
    (b'{"input_ids": []}', None, 400, "input_ids"),
    (b'{"sampling_params": {}}', None, 400, "exactly one of"),
    (b'{"input_ids": [1, 2], "text": "x"}', None, 400, "exactly one of"),
    (b'{"input_ids": [1, 999999]}', None, 400, "outside"),
    (b'{"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}', None, 400, "temperature"),
    (b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}', None, 400, "max_new_tokens"),
    (b'{"input_ids": [1, 2], "sampling_params": {"n": 0}}', None, 400, "'n'"),
    (b'{"input_ids": [1, 2], "sampling_params": {"bogus": 1}}', None, 400, "unknown sampling parameter"),
    (b'{"input_ids": [1, 2], "sampling_params": {"min_p": 0.5}}', None, 400, "not supported"),
    (b'{"input_ids": [1, 2], "stream": true}', None, 400, "not supported"),
    (b'{"input_ids": [[1, 2], [3]], "sampling_params": [{}]}', None, 400, "one per prompt"),
    (b'{"input_ids": [1, 2], "top_logprobs_num": 2}', None, 400, "send 'return_logprob' true"),
    (b'{"input_ids": [1, 2], "return_logprob": true, "top_logprobs_num": 21}', None, 400, "top_logprobs_num"),
    (b'{"input_ids": [1, 2], "return_logprob": true, "logprob_start_len": 0}', None, 400, "logprob_start_len"),
    (b'{"input_ids": [1, 2]}', {"Content-Type": "text/plain"}, 415, "JSON"),
    (b'{"input_ids": [1, 2]}', {"Authorization": ""}, 401, "Unauthorized"),
    (b'{"input_ids": [1, 2]}', {"Authorization": "Bearer wrong"}, 401, "Unauthorized"),
    (b'{"input_ids": [1, 2]}', {"Authorization": f"bearer {KEY}"}, 401, "Unauthorized"),
    (b'{"input_ids": [' + b"1, " * 400000 + b'1]}', None, 413, "max-request-bytes"),
    # the tiny model's context (64 tokens) holds at most 64 x 13 characters (its longest token is "<|endoftext|>")
    (b'{"text": "' + b"1" * 2000 + b'"}', None, 400, "2000 characters, more than the model's context of 64 tokens"),
], ids=lambda v: None)
def test_bad_generate_requests_get_4xx_and_the_server_keeps_serving(srv, body, headers, status, msg):
    got, text = raw(srv, "/generate", body, {"Content-Type": "application/json", **(headers or {})})
    assert got == status and msg in text, text
    ok = call(srv, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    assert len(ok["output_ids"]) >= 1


def test_text_over_max_text_chars_is_refused_before_it_is_tokenized(srv, monkeypatch):
    monkeypatch.setattr(srv.server.cfg, "max_text_chars", 10)
    monkeypatch.setattr(srv.server, "_encode", lambda texts: pytest.fail("tokenized text over --max-text-chars"))
    status, text = raw(srv, "/generate", json.dumps({"text": ["1+2=", "3+4=", "5+6="]}).encode(),
                       {"Content-Type": "application/json"})
    assert status == 400 and "'text' holds 12 characters; at most --max-text-chars 10" in text, text


def test_health_answers_while_a_text_is_tokenized(srv):
    """The tokenizer blocks until released (a long text takes seconds of CPU): /health keeps answering meanwhile,
    then the request completes."""
    real, entered, release = srv.server.tokenizer, threading.Event(), threading.Event()

    class Blocking:
        def __call__(self, text):
            entered.set()
            release.wait(120)
            return real(text)

        def __getattr__(self, name):
            return getattr(real, name)

    srv.server.tokenizer = Blocking()
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        fut = pool.submit(call, srv, "/generate", {"text": "1+2=", "sampling_params": {"max_new_tokens": 2}})
        assert entered.wait(30), "the request never reached the tokenizer"
        host, port = srv.url.removeprefix("http://").split(":")
        for _ in range(3):
            conn = http.client.HTTPConnection(host, int(port), timeout=10)  # a blocked event loop never answers
            try:
                conn.request("GET", "/health")
                assert conn.getresponse().status == 200
            finally:
                conn.close()
    finally:
        release.set()
        srv.server.tokenizer = real
        pool.shutdown(wait=True)
    assert len(fut.result(60)["output_ids"]) >= 1


def test_other_bad_requests(srv):
    assert raw(srv, "/nope", b"", method="GET")[0] == 404
    assert raw(srv, "/generate", b"", method="GET")[0] == 405
    for path, body, msg in (("/get_weights_by_name", {"name": "no.such.weight"}, "no weight"),
                            ("/get_weights_by_name", {}, "missing field 'name'"),
                            ("/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]},
                             "no weight-update group"),
                            ("/update_weights_from_distributed", {"names": ["x"], "dtypes": ["nn"], "shapes": [[1]]},
                             "dtype"),
                            ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                            "world_size": 2, "rank_offset": 5, "backend": "gloo"}, "rank_offset"),
                            ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2,
                                                            "rank_offset": 1, "backend": "nccl"}, "nccl needs CUDA"),
                            ("/update_weight_version", {}, "new_version"),
                            ("/abort_request", {"rid": 5}, "'rid'")):
        with pytest.raises(EngineHTTPError, match=msg) as e:
            call(srv, path, body)
        assert e.value.status == 400, (path, e.value)
    assert call(srv, "/health_generate") == ""


def test_with_a_key_every_endpoint_but_health_needs_it(srv):
    routes = {(r.method, r.resource.canonical) for r in srv.server.app.router.routes() if r.method != "HEAD"}
    assert len(routes) >= 25 and ("POST", "/update_weights_from_disk") in routes
    for method, path in sorted(routes - {("GET", "/health")}):
        status, text = raw(srv, path, b"{}", {"Content-Type": "application/json", "Authorization": ""}, method=method)
        assert status == 401 and "Unauthorized" in text, (method, path, status)
    assert raw(srv, "/health", headers={"Authorization": ""}, method="GET")[0] == 200


def test_off_loopback_without_a_key_only_generation_and_status_answer(tiny_model, srv):
    st = ServerThread(srv.engine, ServerConfig(port=0, allow_unauthenticated_host=True), model_path=tiny_model)
    http = HTTPClient()
    try:
        st.server.loopback = False  # as if bound to a public address (the test stays on loopback)
        for path, body in (("/update_weight_version", {"new_version": "9"}), ("/release_memory_occupation", {}),
                           ("/get_weights_by_name", {"name": "model.norm.weight", "return_format": "base64"}),
                           ("/abort_request", {"abort_all": True}), ("/pause_generation", {}),
                           ("/update_weights_from_disk", {"model_path": "/"}), ("/get_server_info", None)):
            with pytest.raises(EngineHTTPError, match="without an API key") as e:
                http.call(st.url, path, body, timeout=10)
            assert e.value.status == 403, path
        assert http.call(st.url, "/get_model_info", timeout=10)["is_generation"]
        out = http.call(st.url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}, timeout=30)
        assert len(out["output_ids"]) >= 1
    finally:
        http.close()
        st.stop()


def test_max_running_requests_counts_samples_and_answers_429_with_retry_after(tiny_model, srv):
    st = ServerThread(srv.engine, ServerConfig(port=0, max_running_requests=4), model_path=tiny_model)
    http = HTTPClient()
    try:
        http.call(st.url, "/pause_generation", {"mode": "in_place"}, timeout=10)  # requests queue while paused
        futs = [http.call_async(st.url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "n": 2}},
                                timeout=30) for _ in range(2)]
        wait_for(lambda: st.server._inflight == 4, "2 requests x n=2 in flight")
        status, text, headers = raw_with_headers(st, "/generate", b'{"input_ids": [1, 2]}')
        assert status == 429 and "--max-running-requests 4" in text and int(headers["Retry-After"]) >= 1
        assert st.server.stats["rejected_busy"] == 1 and len(st.server._pending) == 2  # nothing queued past the cap
        with pytest.raises(EngineHTTPError, match="can never fit") as e:  # more samples than the cap: never retryable
            http.call(st.url, "/generate", {"input_ids": [[1, 2]] * 5}, timeout=10)
        assert e.value.status == 400
        http.call(st.url, "/continue_generation", {}, timeout=10)
        assert all(len(f.result(35)) == 2 for f in futs)
        assert st.server._inflight == 0
    finally:
        http.close()
        st.stop()


def raw_with_headers(st, path: str, body: bytes) -> tuple[int, str, dict]:
    host, port = st.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace"), dict(r.getheaders())
    finally:
        conn.close()


# ---- the other endpoints -------------------------------------------------------------------------------
def test_info_cache_load_and_version_endpoints(srv):
    info = call(srv, "/get_model_info")
    assert info["is_generation"] is True and info["model_path"] and info["weight_version"] == "0"
    assert call(srv, "/model_info") == info
    si = call(srv, "/get_server_info")
    assert si["tp_size"] == 1 and si["dp_size"] == 1 and si["internal_states"][0]["engine_calls"] >= 1
    assert call(srv, "/get_load")["load"] == 0
    assert call(srv, "/flush_cache", method="GET").startswith("Cache flushed")
    assert call(srv, "/flush_cache", {}).startswith("Cache flushed")
    assert call(srv, "/update_weight_version", {"new_version": "7"})["new_version"] == "7"
    assert call(srv, "/get_weight_version")["weight_version"] == "7"
    out = call(srv, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
    assert out["meta_info"]["weight_version"] == "7"
    call(srv, "/update_weight_version", {"new_version": "0"})


def test_pause_abort_continue(srv):
    assert call(srv, "/pause_generation", {"mode": "in_place"})["status"] == "ok"
    calls = srv.server.stats["engine_calls"]
    queued = srv.http.call_async(srv.url, "/generate", {"input_ids": [[1, 2], [3, 4]], "rid": "q",
                                                        "sampling_params": {"max_new_tokens": 2}}, timeout=30)
    other = srv.http.call_async(srv.url, "/generate", {"input_ids": [5, 6], "rid": "keep",
                                                       "sampling_params": {"max_new_tokens": 2}}, timeout=30)
    wait_for(lambda: len(srv.server._pending) == 3, "3 queued prompts")
    assert not queued.done() and not other.done() and srv.server.stats["engine_calls"] == calls  # paused: nothing runs
    assert call(srv, "/abort_request", {"rid": "q"}) == ""  # both of q's prompts (q_0, q_1)
    outs = queued.result(10)
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort", "abort"]
    assert not other.done()
    call(srv, "/continue_generation", {})
    assert other.result(30)["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    # pause in its default mode aborts what is queued; abort_all too
    call(srv, "/pause_generation", {})
    late = srv.http.call_async(srv.url, "/generate", {"input_ids": [5, 6]}, timeout=30)
    wait_for(lambda: len(srv.server._pending) == 1, "the late request queued")
    call(srv, "/abort_request", {"abort_all": True})
    assert late.result(10)["meta_info"]["finish_reason"]["type"] == "abort"
    call(srv, "/continue_generation", {})


def test_memory_release_and_resume(srv):
    assert call(srv, "/release_memory_occupation", {"tags": ["weights", "kv_cache"]}) is None
    calls = srv.server.stats["engine_calls"]
    fut = srv.http.call_async(srv.url, "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}},
                              timeout=30)
    wait_for(lambda: len(srv.server._pending) == 1, "the request queued")
    assert not fut.done() and srv.server.stats["engine_calls"] == calls  # generation waits for the memory to come back
    assert call(srv, "/resume_memory_occupation", {}) is None
    assert len(fut.result(30)["output_ids"]) >= 1
    with pytest.raises(EngineHTTPError, match="tags"):
        call(srv, "/release_memory_occupation", {"tags": ["gpu"]})


def test_weights_read_back_and_update_from_disk(srv, tiny_model):
    from safetensors.torch import save_file
    tmp_path = srv.weights_dir / "update"
    tmp_path.mkdir()
    name = "model.norm.weight"
    want = srv.engine.get_weight(name)
    assert torch.equal(decode_tensor(call(srv, "/get_weights_by_name", {"name": name, "return_format": "base64"})), want)
    assert call(srv, "/get_weights_by_name", {"name": name}) == want.tolist()  # SGLang's: floats, first rows
    emb = call(srv, "/get_weights_by_name", {"name": "model.embed_tokens.weight", "truncate_size": 2})
    assert len(emb) == 2 and emb[1] == srv.engine.get_weight("model.embed_tokens.weight")[1].tolist()
    sha = call(srv, "/get_weights_by_name", {"name": name, "return_format": "sha256"})
    assert sha["dtype"] == "float32" and sha["shape"] == list(want.shape) and len(sha["sha256"]) == 64

    new = want + 1.0
    save_file({name: new}, str(tmp_path / "w.safetensors"))
    (tmp_path / "w.bin").write_bytes(b"never unpickled")
    r = call(srv, "/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": "3"})
    assert r["success"] is True
    assert torch.equal(srv.engine.get_weight(name), new) and call(srv, "/get_weight_version")["weight_version"] == "3"
    save_file({name: torch.zeros(3)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(EngineHTTPError, match="shape"):
        call(srv, "/update_weights_from_disk", {"model_path": str(tmp_path)})
    save_file({name: want}, str(tmp_path / "w.safetensors"))
    call(srv, "/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": "0"})
    assert torch.equal(srv.engine.get_weight(name), want)


def test_weight_update_group_endpoints(srv):
    from polyrl.weight_sync.distributed import DistributedTransport

    class Eng:  # the members a transport uses when every push succeeds
        http, membership, fault_tolerant = srv.http, 0, False
        pushed: list = []

        def weight_sync_urls(self):
            return [srv.url]

        def weights_pushed(self, version, urls=None):
            self.pushed.append(version)

    name = "model.layers.0.mlp.up_proj.weight"
    old = srv.engine.get_weight(name)
    tr = DistributedTransport(1 << 20, device="cpu", timeout_s=60)
    try:
        tr.push(iter([(name, old * 2)]), Eng(), 11)
        assert torch.equal(srv.engine.get_weight(name), old * 2) and call(srv, "/get_weight_version")["weight_version"] == "11"
        tr.push(iter([(name, old)]), Eng(), 12)
        assert torch.equal(srv.engine.get_weight(name), old) and tr.builds == 1
    finally:
        tr.close()  # POSTs /destroy_weights_update_group
    with pytest.raises(EngineHTTPError, match="does not exist"):
        call(srv, "/destroy_weights_update_group", {"group_name": "polyrl_weight_update_group"})
    call(srv, "/update_weight_version", {"new_version": "0"})


# ---- the CLI and the router ------------------------------------------------------------------------------
def test_polyrl_serve_cli_help_start_line_and_sigterm(tiny_model, tmp_path):
    from serve_procs import ServeProc
    h = subprocess.run([sys.executable, "-m", "polyrl", "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert h.returncode == 0
    for group in ("server (polyrl serve):", "model / backend:", "rollout:", "cluster / backend:"):
        assert group in h.stdout
    assert "--api-key" in h.stdout and "--rollout-mem-fraction" in h.stdout and "--prompt-data" not in h.stdout
    p = ServeProc(tiny_model, str(tmp_path / "serve.log"), "--api-key", KEY).ready(120)
    http = HTTPClient(api_key=KEY)
    try:
        assert p.url.startswith("http://127.0.0.1:") and not p.url.endswith(":0")
        out = http.call(p.url, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}}, timeout=30)
        assert len(out["output_ids"]) >= 1
    finally:
        http.close()
        t0 = time.monotonic()
        assert p.stop(signal.SIGTERM) == 0 and time.monotonic() - t0 < 10


def test_the_router_gets_a_key_that_begins_with_a_dash(monkeypatch):
    """A launched run's random key (secrets.token_urlsafe) begins with "-" once in 64: the router's entry point hands it
    to sglang-router's parser as one token, never as a flag of its own."""
    pytest.importorskip("sglang_router")
    import sglang_router.launch_router as lr
    from polyrl.rollout import router
    got = []
    monkeypatch.setattr(lr, "launch_router", got.append)
    monkeypatch.setenv(router.API_KEY_ENV, "-Ab3_secret")
    router.main(["--worker-urls", "http://127.0.0.1:1", "--policy", "round_robin"])
    (args,) = got
    assert args.api_key == "-Ab3_secret" and router.API_KEY_ENV not in os.environ


def test_behind_the_real_sglang_router(tiny_model, srv, tmp_path):
    pytest.importorskip("sglang_router")
    from polyrl.rollout.router import launch_router
    other = ServerThread(srv.engine, ServerConfig(port=0, api_key=KEY), model_path=tiny_model)
    router = None
    try:
        router = launch_router([srv.url, other.url], log_path=str(tmp_path / "router.log"), policy="round_robin",
                               api_key=KEY, timeout=60)
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 5, "sampling_seed": 3}, "return_logprob": True}
        direct = call(srv, "/generate", body)
        for _ in range(4):  # round robin: both workers answer, the same
            via = srv.http.call(router.url, "/generate", body, timeout=30)
            assert via["output_ids"] == direct["output_ids"]
        keyless = HTTPClient()
        try:
            with pytest.raises(EngineHTTPError) as e:  # the router wants the key too
                keyless.call(router.url, "/generate", body, timeout=30)
            assert e.value.status == 401
        finally:
            keyless.close()
    finally:
        if router is not None:
            router.stop()
            assert router.proc.poll() is not None
        other.stop()
    with pytest.raises(RuntimeError, match=r"sglang-router \(http://127\.0\.0\.1:\d+, log .*router2\.log\) exited"):
        launch_router([srv.url], log_path=str(tmp_path / "router2.log"), policy="power_of_two", timeout=30)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_spawned_children_outlive_their_starting_thread_and_die_with_the_process():
    from polyrl.rollout.router import spawn
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("p", spawn(["sleep", "30"])))
    t.start()
    t.join(10)
    time.sleep(0.3)
    assert box["p"].poll() is None  # the kernel ties the death signal to a thread: not this short-lived one
    box["p"].kill()
    box["p"].wait(10)
    code = ("import sys, time; from polyrl.rollout.router import spawn; "
            "print(spawn(['sleep', '30']).pid, flush=True); time.sleep(30)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait(10)
    parent.stdout.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
        time.sleep(0.05)  # killed by the kernel; reaped by init
    assert not os.path.exists(f"/proc/{pid}"), "the child outlived its parent"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_path_batched_requests_equal_direct_generate_and_memory_release(tmp_path):
    from conftest import make_model_dir
    from polyrl.rollout.gpu import GPUEngine
    model = make_model_dir(tmp_path / "m", hidden=128, layers=2)
    eng = make_embedded_engine(model, device="cuda", dtype=torch.bfloat16, mem_fraction=0.2)
    assert isinstance(eng, GPUEngine)
    st = ServerThread(eng, ServerConfig(port=0), model_path=model)
    http = HTTPClient()
    try:
        ps = [[5 + i % 7, 6, 7 + i % 3] for i in range(64)]
        sp = {"max_new_tokens": 24, "temperature": 1.0}
        futs = [http.call_async(st.url, "/generate", {"input_ids": p, "return_logprob": True,
                                                      "sampling_params": {**sp, "sampling_seed": 100 + i}}, timeout=120)
                for i, p in enumerate(ps)]
        got = [f.result(130) for f in futs]
        assert st.server.stats["engine_calls"] <= 4
        # max_new_tokens is cut to what the context leaves (the GPU path's positions)
        long = http.call(st.url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**7}}, timeout=60)
        assert long["meta_info"]["finish_reason"]["type"] in ("stop", "length") and len(long["output_ids"]) <= eng.max_len - 2
        free0 = torch.cuda.mem_get_info()[0]
        http.call(st.url, "/release_memory_occupation", {}, timeout=60)
        assert torch.cuda.mem_get_info()[0] > free0  # weights and KV cache left the GPU
        http.call(st.url, "/resume_memory_occupation", {}, timeout=60)
        want = eng.generate(ps, SamplingParams(temperature=1.0, max_new_tokens=24, prompt_seeds=[100 + i for i in range(64)]))
        assert [o["output_ids"] for o in got] == [w.response_ids for w in want]
    finally:
        http.close()
        st.stop()
