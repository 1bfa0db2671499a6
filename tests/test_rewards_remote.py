"""--rm-url: the remote reward model client against a small reward server this file starts on 127.0.0.1.

The server's paths are its behaviours: /score answers, /slow answers past the client's --rm-timeout,
/error answers HTTP 500, /flaky fails its first two requests, /short and /nan answer malformed bodies.
Every request loop here is bounded in count (the server counts requests per path) and in time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from polyrl.cli import main
from polyrl.rewards import RewardManager
from polyrl.rewards.remote import RemoteRewardModel
from polyrl.rollout.http_client import EngineHTTPError
from polyrl.types import Sample


def digits_reward(response: str) -> float:
    return sum(c.isdigit() for c in response) / 8.0


class RewardServer:
    def __init__(self, slow_s: float = 60.0, work_s: float = 0.0, pair: bool = False):
        self.slow_s, self.work_s = slow_s, work_s
        self.counts: dict[str, int] = {}
        self.in_flight = self.max_in_flight = 0
        # pair: the first request waits (bounded) until a second one is in flight, so a client that may send two at
        # once is seen doing so whatever the machine's load, and one that sends one at a time is seen too
        self.paired = threading.Event()
        if not pair:
            self.paired.set()
        self.bodies: list[dict] = []
        self.lock, self.stopping = threading.Lock(), threading.Event()
        srv = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                path = self.path
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with srv.lock:
                    n_path = srv.counts[path] = srv.counts.get(path, 0) + 1
                    srv.in_flight += 1
                    srv.max_in_flight = max(srv.max_in_flight, srv.in_flight)
                    srv.bodies.append(body)
                    if srv.in_flight >= 2:
                        srv.paired.set()
                try:
                    srv.paired.wait(10)
                    srv.stopping.wait(srv.work_s)
                    rewards = [digits_reward(r) for r in body["responses"]]
                    status = 200
                    if path == "/slow":
                        srv.stopping.wait(srv.slow_s)  # returns at once when the server stops
                    elif path == "/error" or (path == "/flaky" and n_path <= 2):
                        status = 500
                    elif path == "/short":
                        rewards = rewards[:-1]
                    elif path == "/nan":
                        rewards[1] = "high"
                finally:
                    # A request stops counting as in flight before its answer leaves: once the client has the
                    # answer it may send the next request before this thread would run a later decrement.
                    with srv.lock:
                        srv.in_flight -= 1
                self._send(status, {"rewards": rewards} if status == 200 else {"error": "boom"})

            def _send(self, status, obj):
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except OSError:  # the client gave up (timeout): nothing to answer
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def stop(self):
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def server():
    srv = RewardServer()
    yield srv
    srv.stop()


def bounded(fn, what: str, limit_s: float = 30.0):
    """fn() on a daemon thread, failing with `what` if it has not returned within limit_s (a bound on a wait that a
    broken timeout would make last a minute, not a claim about speed)."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(limit_s)
    assert out, f"{what} did not return within {limit_s:g} s"
    return out[0]


def samples(n: int) -> list[Sample]:
    return [Sample(prompt_ids=[1], response_ids=[2], rollout_logprobs=[0.0], finish_reason="stop", group_index=i // 2,
                   prompt=f"p{i}", response="1" * (i % 9), label=str(i), metadata={"i": i}) for i in range(n)]


def manager(url: str, **kw) -> RewardManager:
    kw = {"batch_size": 3, "max_concurrency": 2, "retries": 2, "timeout": 5.0, "backoff_s": 0.01, **kw}
    return RewardManager(None, remote=RemoteRewardModel(url, **kw))


def test_batches_carry_the_documented_payload_and_rewards_come_back_in_order(server):
    rm, ss = manager(server.url + "/score"), samples(10)
    try:
        m = rm.score(ss)
    finally:
        rm.close()
    assert [s.reward for s in ss] == [digits_reward(s.response) for s in ss]
    assert server.counts == {"/score": 4}  # 10 samples in batches of 3
    assert sorted(len(b["prompts"]) for b in server.bodies) == [1, 3, 3, 3]
    first = min(server.bodies, key=lambda b: b["metadata"][0]["i"])
    assert first == {"prompts": ["p0", "p1", "p2"], "responses": ["", "1", "11"], "labels": ["0", "1", "2"],
                     "metadata": [{"i": 0}, {"i": 1}, {"i": 2}]}
    assert m["reward/errors"] == 0 and m["reward/remote_failures"] == 0 and m["reward/remote_retries"] == 0
    assert m["reward/mean"] == pytest.approx(sum(s.reward for s in ss) / 10)


def test_concurrency_is_bounded_by_rm_max_concurrency():
    # the first request is held until a second arrives (so 2 at once is reached), and each is held 0.15 s more, so a
    # client that sent more than 2 at once would have them overlap on the server and count above 2
    srv = RewardServer(work_s=0.15, pair=True)
    rm = manager(srv.url + "/score", batch_size=1, max_concurrency=2)
    try:
        rm.score(samples(8))
    finally:
        rm.close()
        srv.stop()
    assert srv.counts == {"/score": 8} and srv.max_in_flight == 2


def test_slow_answers_time_out_are_retried_then_score_zero(caplog):
    # /slow answers after 60 s (at once when the server stops): a client that waited for the answer instead of its
    # 0.3 s --rm-timeout would not return within the 30 s bound
    srv = RewardServer()
    rm, ss = manager(srv.url + "/slow", timeout=0.3, retries=1), samples(6)
    try:
        with caplog.at_level(logging.WARNING, logger="polyrl.rewards.remote"):
            m = bounded(lambda: rm.score(ss), "scoring against a server that answers after 60 s")
    finally:
        rm.close()
        srv.stop()
    assert all(s.reward == 0.0 for s in ss)
    assert (m["reward/errors"], m["reward/remote_failures"], m["reward/remote_retries"]) == (6, 2, 2)
    assert srv.counts == {"/slow": 4}  # 2 batches x (1 try + 1 retry)
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1 and "failed after 1 retries" in logged[0] and "no answer within 0.3 s" in logged[0]


class _SleepRecorder:
    """The asyncio module as polyrl.rewards.remote sees it, with every sleep's length recorded (the backoffs)."""

    def __init__(self):
        self.sleeps: list[float] = []

    def __getattr__(self, name):
        return getattr(asyncio, name)

    async def sleep(self, delay, *args):
        self.sleeps.append(delay)
        return await asyncio.sleep(delay, *args)


def test_http_500_is_retried_with_backoff_then_counted(server, monkeypatch):
    import polyrl.rewards.remote as remote
    recorder = _SleepRecorder()
    monkeypatch.setattr(remote, "asyncio", recorder)
    rm, ss = manager(server.url + "/error", retries=2, backoff_s=0.05), samples(4)
    m = bounded(lambda: rm.score(ss), "scoring against a server that answers HTTP 500")
    rm.close()
    assert server.counts == {"/error": 6}  # 2 batches x 3 attempts
    assert sorted(recorder.sleeps) == [0.05, 0.05, 0.1, 0.1]  # per batch, the backoff doubles: 0.05 s, then 0.1 s
    assert (m["reward/errors"], m["reward/remote_failures"], m["reward/remote_retries"]) == (4, 2, 4)
    assert m["reward/mean"] == 0.0 and rm.errors_total == 4


def test_a_request_that_succeeds_on_retry_keeps_its_rewards(server):
    rm, ss = manager(server.url + "/flaky", batch_size=10, retries=3), samples(5)
    m = rm.score(ss)
    rm.close()
    assert server.counts == {"/flaky": 3}
    assert [s.reward for s in ss] == [digits_reward(s.response) for s in ss]
    assert (m["reward/errors"], m["reward/remote_failures"], m["reward/remote_retries"]) == (0, 0, 2)


def test_malformed_answers_are_not_retried(server, caplog):
    rm, ss = manager(server.url + "/short", batch_size=10), samples(4)
    with caplog.at_level(logging.WARNING, logger="polyrl.rewards.remote"):
        m = rm.score(ss)
    assert server.counts == {"/short": 1}  # the server answered: asking again would get the same
    assert m["reward/errors"] == 4 and m["reward/remote_failures"] == 1 and all(s.reward == 0 for s in ss)
    assert "expected {\"rewards\": [4 numbers]} for 4 samples, got 3 rewards" in caplog.text
    rm.close()
    # one value that is not a number costs only its sample
    rm, ss = manager(server.url + "/nan", batch_size=10), samples(4)
    m = rm.score(ss)
    rm.close()
    assert [s.reward for s in ss] == [0.0, 0.0, 2 / 8, 3 / 8]
    assert m["reward/errors"] == 1 and m["reward/remote_failures"] == 0


def test_a_server_that_is_not_there_fails_fast():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rm, ss = manager(f"127.0.0.1:{port}/score", retries=1), samples(3)
    values, failures, retried = bounded(lambda: rm.remote.score(ss), "scoring against a closed port")
    m = rm.score(ss)
    rm.close()
    assert (failures, retried) == (1, 1) and m["reward/remote_failures"] == 1 and m["reward/errors"] == 3
    # refused at connect, not waited for until the 5 s --rm-timeout: the error names the connection, not a timeout
    assert all(isinstance(v, EngineHTTPError) and v.status is None and "no answer within" not in str(v) for v in values)


def test_train_with_rm_url_two_steps(server, tiny_model, arith_data, tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--rm-url", server.url + "/score",
                 "--rm-batch-size", "3", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                 "--rollout-max-response-len", "6", "--num-rollout", "2", "--quiet", "--device", "cpu",
                 "--run-dir", str(run)]) == 0
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    assert server.counts == {"/score": 4}  # 4 samples per step in batches of 3: 2 requests per step
    for r in rows:
        assert r["reward/errors"] == 0 and r["reward/remote_failures"] == 0 and "loss" in r
    sent = [resp for b in server.bodies for resp in b["responses"]]
    assert sum(r["reward/mean"] for r in rows) * 4 == pytest.approx(sum(digits_reward(x) for x in sent))


@pytest.mark.parametrize("argv, needle", [
    (["--rm-url", "http://127.0.0.1:1/score", "--custom-rm-path", "x.py:f"], "--rm-url and --custom-rm-path"),
    (["--rm-url", "http://127.0.0.1:1/score", "--rm-type", "math"], "--rm-url and --rm-type"),
    (["--rm-url", "ftp://host/score"], "expected an http:// or https:// URL"),
    (["--rm-url", "http://127.0.0.1:1/score", "--rm-max-concurrency", "0"], "--rm-max-concurrency must be >= 1"),
    (["--rm-url", "http://127.0.0.1:1/score", "--rm-retries", "-1"], "--rm-retries must be >= 0"),
    ([], "--rm-url URL"),  # no reward at all: the message lists the remote option
])
def test_remote_rm_flag_errors(argv, needle, tiny_model, arith_data, capsys):
    assert main(["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], *argv]) == 2
    assert needle in capsys.readouterr().err
