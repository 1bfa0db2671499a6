"""Partial responses over HTTP: `polyrl serve` honours polyrl_stop_length as the embedded engine does, answers
/abort_request of a running request with the tokens it generated (SGLang's partial output), and the HTTP engine's
watch aborts what is still out once it stops. The server runs in this process on a slowed engine, so that a request
is surely mid-generation when it is aborted; every wait is bounded."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from polyrl.config import Config, ServerConfig
from polyrl.rollout.base import GenerateWatch
from polyrl.rollout.embedded import EmbeddedEngine
from polyrl.rollout.http_client import HTTPClient
from polyrl.rollout.http_engine import HTTPEngine
from polyrl.rollout.server import ServerThread
from polyrl.types import SamplingParams

KEY = "test-key"
LOGPROB_TOL = 1e-4  # the same FP32 model in other batch compositions (tests/rollout/test_server.py)


class SlowEngine(EmbeddedEngine):
    """Each decode step takes a few milliseconds more: an abort lands mid-generation."""

    def generate(self, prompts, params, should_stop=None, **kw):
        def slow(i):
            time.sleep(0.002)
            return should_stop(i)
        return super().generate(prompts, params, slow if should_stop is not None else None, **kw)


@pytest.fixture(scope="module")
def srv(tiny_model):
    st = ServerThread(SlowEngine(tiny_model, dtype=torch.float32), ServerConfig(port=0, api_key=KEY, batch_wait_ms=5),
                      model_path=tiny_model, seed=0)
    st.http = HTTPClient(api_key=KEY)
    try:
        yield st
    finally:
        st.http.close()
        st.stop()


@pytest.fixture(scope="module")
def ref(tiny_model):
    return EmbeddedEngine(tiny_model, dtype=torch.float32)


def ids(tok, k: int) -> list[list[int]]:
    return [tok(f"{a}+{a * 7 % 50}=")["input_ids"] for a in range(k)]


def test_stop_length_over_http_equals_the_embedded_engine(srv, ref):
    p = ids(ref.tokenizer, 1)[0]
    want = ref.generate([p, p], SamplingParams(max_new_tokens=20, prompt_seeds=[5, 6], stop_lengths=[4, 9]))
    for seed, L, w in zip((5, 6), (4, 9), want):
        o = srv.http.call(srv.url, "/generate", {"input_ids": p, "return_logprob": True, "sampling_params": {
            "max_new_tokens": 20, "sampling_seed": seed, "polyrl_stop_length": L}}, timeout=30)
        assert o["output_ids"] == w.response_ids and len(w.response_ids) == L
        assert o["meta_info"]["finish_reason"]["type"] == "stop"
    bad = srv.http.call_async(srv.url, "/generate", {"input_ids": p, "sampling_params": {"n": 2, "polyrl_stop_length": 3}})
    with pytest.raises(Exception, match="n 1"):
        bad.result(30)


def test_abort_request_answers_a_running_request_with_its_tokens(srv, ref):
    p = ids(ref.tokenizer, 1)[0]
    # a seed whose response runs long (the random model emits EOS at random)
    seed, whole = next((s, w) for s in range(200) for w in ref.generate([p], SamplingParams(
        max_new_tokens=50, prompt_seeds=[s])) if len(w.response_ids) >= 40)
    fut = srv.http.call_async(srv.url, "/generate", {"input_ids": p, "rid": "long", "return_logprob": True,
                                                      "sampling_params": {"max_new_tokens": 50, "sampling_seed": seed}},
                              timeout=60)
    deadline = time.monotonic() + 30
    while not srv.server._running and time.monotonic() < deadline:  # the engine call has begun
        time.sleep(0.005)
    time.sleep(0.05)
    srv.http.call(srv.url, "/abort_request", {"rid": "long"}, timeout=30)
    o = fut.result(30)
    got = o["output_ids"]
    assert o["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(got) < 50
    assert got == whole.response_ids[:len(got)]
    lps = [x[0] for x in o["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(lps, whole.rollout_logprobs)) < LOGPROB_TOL


class StopAfter(GenerateWatch):
    def __init__(self, k: int):
        super().__init__()
        self.k, self.seen, self.lock = k, [], threading.Lock()

    def finished(self, index, sample):
        with self.lock:
            self.seen.append(index)
            if len(self.seen) >= self.k:
                self.stop.set()


def test_http_engine_watch_aborts_what_is_out_and_keeps_the_partial_tokens(srv, ref, tiny_model, tmp_path):
    cfg = Config()
    cfg.model.hf_checkpoint, cfg.cluster.device, cfg.log.run_dir = tiny_model, "cpu", str(tmp_path)
    e = cfg.engines
    e.rollout_external, e.rollout_external_engine_addrs, e.api_key = True, [srv.url], KEY
    eng = HTTPEngine(cfg, "cpu")
    try:
        ps = ids(ref.tokenizer, 3)
        stops = [2, 3, 0, 0, 0, 0]  # two samples end at once; the others would run to the context
        sp = SamplingParams(max_new_tokens=50, n=2, seed=4, stop_lengths=stops)
        watch = StopAfter(2)
        got = eng.generate(ps, sp, watch=watch)
        want = ref.generate(ps, sp)
    finally:
        eng.close()
    assert sorted(watch.seen) == [0, 1]
    for k, (g, w) in enumerate(zip(got, want)):
        if k < 2:
            assert g.response_ids == w.response_ids and g.finish_reason == "stop" and g.loss_mask[-1] == 0
        else:
            assert g.finish_reason == "abort" and len(g.response_ids) < len(w.response_ids)
            assert g.response_ids == w.response_ids[:len(g.response_ids)]


def test_a_request_aborted_while_queued_comes_back_empty_and_a_short_answer_is_an_error():
    """SGLang (and polyrl serve) answer a request aborted before it ran with no tokens and no log-prob field; a faster
    abort makes that common, and it is a partial sample of length 0, not a KeyError. An answer whose log-probs do not
    cover its tokens is refused by name."""
    queued = {"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "aborted"},
                                                          "prompt_tokens": 6, "completion_tokens": 0}}
    assert HTTPEngine._to_sample_fields(queued) == ([], [], "abort")
    short = {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "length"},
                                                 "output_token_logprobs": [[-0.5, 5, None]]}}
    with pytest.raises(ValueError, match="2 output ids carries 1 output_token_logprobs"):
        HTTPEngine._to_sample_fields(short)
