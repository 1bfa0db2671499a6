"""`polyrl serve` safe by default (CPU, loopback only): a public --host without a key refused at start-up,
keys from a file or the environment and never on a command line (also for the servers and the router
`polyrl train` launches), /update_weights_from_disk confined to --allowed-weight-dirs and checked from
the safetensors header, and bounded work per request: prompts, n, max_new_tokens cut to the context,
and a generation that stops when its request is aborted, passes its deadline or loses its client.
Every server is started and stopped by its test; every wait is bounded and names what it waited for."""

from __future__ import annotations

import http.client
import json
import os
import socket
import stat
import threading
import time

import pytest
import torch

from polyrl.config import ServerConfig
from polyrl.rollout.embedded import EmbeddedEngine
from polyrl.rollout.http_client import EngineHTTPError, HTTPClient
from polyrl.rollout.server import ServerThread
from polyrl.types import SamplingParams

KEY = "s3cret-test-key-0123456789"


def wait_for(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(0.01)


def cmdlines_holding(secret: str) -> list[str]:
    """Every process on this machine whose command line holds `secret` (/proc/PID/cmdline: readable by all users)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if secret.encode() in cmd:
            found.append(f"{pid}: {cmd.replace(bytes(1), b' ')[:200]!r}")
    return found


# ---- start-up ----------------------------------------------------------------------------------------
def test_a_public_host_without_a_key_is_refused_at_start_up(tiny_model, tmp_path, monkeypatch, capsys):
    from polyrl.cli import main
    monkeypatch.delenv("POLYRL_API_KEY", raising=False)
    base = ["serve", "--hf-checkpoint", tiny_model, "--device", "cpu", "--port", "0"]
    assert main([*base, "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "--host 0.0.0.0" in err and "--api-key" in err and "--allow-unauthenticated-host" in err
    assert main([*base, "--api-key-file", str(tmp_path / "missing")]) == 2
    assert "--api-key-file" in capsys.readouterr().err
    (tmp_path / "empty").write_text("\n")
    assert main([*base, "--api-key-file", str(tmp_path / "empty")]) == 2
    assert "empty" in capsys.readouterr().err
    assert main([*base, "--api-key", "k", "--api-key-file", str(tmp_path / "empty")]) == 2
    assert "alternatives" in capsys.readouterr().err


def test_the_opt_in_flag_and_a_key_let_a_public_host_start(tiny_model, tmp_path, monkeypatch):
    """serve() up to the socket (the event loop is stubbed: a test never binds a public address)."""
    from polyrl.cli import build_parser
    from polyrl.config import config_from_args
    from polyrl.rollout import server as srv
    handed = {}
    monkeypatch.setattr(srv, "EngineServer", lambda engine, s, **kw: handed.update(server=s))
    monkeypatch.setattr(srv.asyncio, "run", lambda coro: coro.close())
    monkeypatch.delenv("POLYRL_API_KEY", raising=False)
    base = ["serve", "--hf-checkpoint", tiny_model, "--device", "cpu", "--host", "0.0.0.0"]
    assert srv.serve(config_from_args(build_parser().parse_args([*base, "--allow-unauthenticated-host"]))) == 0
    assert handed["server"].api_key is None
    monkeypatch.setenv("POLYRL_API_KEY", KEY)
    assert srv.serve(config_from_args(build_parser().parse_args(base))) == 0
    assert handed["server"].api_key == KEY


@pytest.mark.slow
@pytest.mark.parametrize("how", ["file", "env"])
def test_the_key_from_a_file_or_the_environment_guards_the_server_and_stays_off_its_command_line(
        tiny_model, tmp_path, monkeypatch, how):
    from serve_procs import ServeProc
    args = ()
    if how == "file":
        kf = tmp_path / "key"
        kf.write_text(KEY + "\n")
        kf.chmod(0o600)
        args = ("--api-key-file", str(kf))
    else:
        monkeypatch.setenv("POLYRL_API_KEY", KEY)
    p = ServeProc(tiny_model, str(tmp_path / "serve.log"), *args).ready(120)
    keyed, keyless = HTTPClient(api_key=KEY), HTTPClient()
    try:
        with pytest.raises(EngineHTTPError) as e:
            keyless.call(p.url, "/generate", {"input_ids": [1, 2]}, timeout=30)
        assert e.value.status == 401
        assert keyless.call(p.url, "/health", timeout=30) == ""
        assert len(keyed.call(p.url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}},
                              timeout=30)["output_ids"]) >= 1
        assert cmdlines_holding(KEY) == []
    finally:
        keyed.close()
        keyless.close()
        p.stop()
    assert KEY not in open(tmp_path / "serve.log").read()


@pytest.mark.slow
def test_launched_servers_and_router_get_a_random_key_that_no_command_line_log_or_config_holds(tiny_model, tmp_path):
    from polyrl.config import Config
    from polyrl.rollout.http_engine import HTTPEngine
    from polyrl.weight_sync.distributed import DiskTransport, private_weight_dir
    router = pytest.importorskip("sglang_router") is not None
    cfg = Config()
    cfg.model.hf_checkpoint = tiny_model
    cfg.cluster.device = "cpu"
    cfg.rollout.rollout_engine = "server"
    cfg.log.run_dir = str(tmp_path / "run")
    e = cfg.engines
    e.rollout_num_engines, e.rollout_engine_startup_timeout, e.rollout_request_timeout = 2, 120, 60
    e.use_sglang_router, e.weight_sync = router, "disk"
    eng = HTTPEngine(cfg, "cpu")
    keyless = HTTPClient()
    try:
        key = eng.api_key
        assert key and len(key) >= 32 and cfg.engines.api_key is None  # held by the engine, not written to the config
        assert cmdlines_holding(key) == []
        pids = [s.proc.pid for s in eng.servers] + ([eng.router.proc.pid] if eng.router else [])
        assert len(pids) == 3
        for s in eng.servers:  # a local user without the key gets nothing but /health, loopback or not
            with pytest.raises(EngineHTTPError) as err:
                keyless.call(s.url, "/get_weights_by_name", {"name": "model.norm.weight"}, timeout=30)
            assert err.value.status == 401
        out = eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, seed=0, n=2))
        assert len(out) == 2
        # --weight-sync disk: the servers load what the transport writes in this user's directory, nothing else
        w = {"model.norm.weight": torch.full_like(EmbeddedEngine(tiny_model).get_weight("model.norm.weight"), 0.5)}
        DiskTransport(1 << 20, check_equal=True).push(iter(w.items()), eng, 1)
        assert stat.S_IMODE(os.stat(private_weight_dir()).st_mode) == 0o700
        outside = tmp_path / "elsewhere"
        outside.mkdir()
        with pytest.raises(EngineHTTPError) as err:
            eng.http.call(eng.servers[0].url, "/update_weights_from_disk", {"model_path": str(outside)}, timeout=30)
        assert err.value.status == 403
        for name in os.listdir(tmp_path / "run" / "engines"):  # logs: this user's only, and without the key
            path = tmp_path / "run" / "engines" / name
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, name
            assert key not in path.read_text(errors="replace"), name
    finally:
        keyless.close()
        eng.close()


# ---- /update_weights_from_disk ---------------------------------------------------------------------------
class ReadCountingEngine(EmbeddedEngine):
    """Counts the tensors update_weights loads."""

    def update_weights(self, weights, version):
        weights = list(weights)
        self.loaded += len(weights)
        return super().update_weights(iter(weights), version)


@pytest.fixture(scope="module")
def disk_srv(tiny_model, tmp_path_factory):
    allowed = tmp_path_factory.mktemp("allowed")
    eng = ReadCountingEngine(tiny_model, dtype=torch.float32)
    eng.loaded = 0
    st = ServerThread(eng, ServerConfig(port=0, allowed_weight_dirs=[str(allowed)]), model_path=tiny_model)
    st.http, st.engine, st.allowed, st.outside = HTTPClient(), eng, allowed, tmp_path_factory.mktemp("outside")
    try:
        yield st
    finally:
        st.http.close()
        st.stop()


def disk_update(st, path) -> tuple[int | None, str]:
    try:
        st.http.call(st.url, "/update_weights_from_disk", {"model_path": str(path)}, timeout=30)
        return 200, ""
    except EngineHTTPError as e:
        return e.status, str(e).split(": ", 2)[-1].replace(repr(str(path)), "PATH")


def test_disk_updates_read_only_under_the_allowed_dirs_and_say_the_same_whether_missing_or_forbidden(disk_srv):
    from safetensors.torch import save_file
    st = disk_srv
    w = st.engine.get_weight("model.norm.weight")
    for d in (st.allowed / "good", st.outside / "secret"):
        d.mkdir()
        save_file({"model.norm.weight": w + 1}, str(d / "w.safetensors"))
    (st.allowed / "link_out").symlink_to(st.outside / "secret")  # a symlink inside pointing outside
    (st.allowed / "file_link").mkdir()
    (st.allowed / "file_link" / "w.safetensors").symlink_to(st.outside / "secret" / "w.safetensors")
    answers = {name: disk_update(st, path) for name, path in (
        ("outside", st.outside / "secret"), ("missing outside", st.outside / "nothing"),
        ("missing inside", st.allowed / "nothing"), ("dotdot", st.allowed / ".." / st.outside.name / "secret"),
        ("dir symlink", st.allowed / "link_out"), ("file symlink", st.allowed / "file_link"), ("root", "/"))}
    assert len(set(answers.values())) == 1, answers  # one status and one text: nothing learnt about the disk
    assert next(iter(answers.values()))[0] == 403 and st.engine.loaded == 0
    assert disk_update(st, st.allowed / "good") == (200, "")
    assert torch.equal(st.engine.get_weight("model.norm.weight"), w + 1) and st.engine.loaded == 1
    st.engine.update_weights(iter([("model.norm.weight", w)]), 0)


def test_disk_updates_check_names_dtypes_and_shapes_from_the_header_before_loading(disk_srv):
    from safetensors.torch import save_file
    st = disk_srv
    w = st.engine.get_weight("model.norm.weight")
    before = st.engine.loaded
    for name, tensors, msg in (
            ("shape", {"model.norm.weight": torch.zeros(3)}, "shape [3]"),
            ("name", {"model.norm.weight": w, "no.such.weight": torch.zeros(2)}, "does not have"),
            ("dtype", {"model.norm.weight": torch.zeros(w.shape, dtype=torch.int32)}, "dtype I32")):
        d = st.allowed / f"bad_{name}"
        d.mkdir()
        save_file(tensors, str(d / "w.safetensors"))
        status, text = disk_update(st, d)
        assert status == 400 and msg in text, (name, text)
    d = st.allowed / "garbage"
    d.mkdir()
    (d / "w.safetensors").write_bytes(b"\xff" * 64)
    status, text = disk_update(st, d)
    assert status == 400 and "not a readable safetensors file" in text
    assert st.engine.loaded == before  # nothing was loaded from any of them
    assert torch.equal(st.engine.get_weight("model.norm.weight"), w)


def test_without_allowed_dirs_disk_updates_are_refused(tiny_model, disk_srv):
    st = ServerThread(disk_srv.engine, ServerConfig(port=0), model_path=tiny_model)
    try:
        with pytest.raises(EngineHTTPError, match="without --allowed-weight-dirs") as e:
            disk_srv.http.call(st.url, "/update_weights_from_disk", {"model_path": str(disk_srv.allowed)}, timeout=30)
        assert e.value.status == 403
    finally:
        st.stop()


# ---- bounded work ---------------------------------------------------------------------------------------
class SteppedEngine(EmbeddedEngine):
    """The embedded engine; after arm(k), the next call holds at its k-th decode step until `go` is set (the
    test acts meanwhile: abort, deadline, hang-up), then asks the server whether to stop. Keeps the last samples."""

    hold_at: int | None = None

    def arm(self, k: int) -> None:
        self.hold_at, self.reached, self.go = k, threading.Event(), threading.Event()

    def generate(self, prompts, params, should_stop=None, **kw):
        asked, hold, self.hold_at = [0], self.hold_at, None

        def stop(i: int) -> bool:
            asked[0] += 1
            if asked[0] == hold:
                self.reached.set()
                assert self.go.wait(30), "the test never released the held decode step"
            return should_stop(i)
        self.last = super().generate(prompts, params, stop if should_stop is not None else None, **kw)
        return self.last


@pytest.fixture(scope="module")
def bounded(tiny_model):
    eng = SteppedEngine(tiny_model, dtype=torch.float32)
    st = ServerThread(eng, ServerConfig(port=0, max_prompts_per_request=4, max_n=3, max_running_requests=16,
                                        request_timeout_s=300), model_path=tiny_model, seed=0)
    st.http, st.engine = HTTPClient(), eng
    # greedy from this prompt never meets EOS in the context (sampled, the 15-token vocabulary meets it soon)
    free = eng.generate([LONG_PROMPT], SamplingParams(temperature=0.0, max_new_tokens=64 - len(LONG_PROMPT)))[0]
    assert free.finish_reason == "length", "the tiny model's greedy path changed: pick another LONG_PROMPT"
    try:
        yield st
    finally:
        st.http.close()
        st.stop()


LONG_PROMPT = [3, 12, 4, 13]
GREEDY_40 = {"max_new_tokens": 40, "temperature": 0.0}


def gen(st, body: dict, timeout: float = 60):
    return st.http.call(st.url, "/generate", body, timeout=timeout)


def test_max_new_tokens_is_cut_to_the_context_and_long_prompts_are_refused(bounded):
    st = bounded
    ctx = st.server.max_len
    assert ctx == 64  # the tiny model's max_position_embeddings
    prompt = LONG_PROMPT
    before = st.server.stats["clamped"]
    o = gen(st, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 100000, "temperature": 0.0}})
    assert st.server.stats["clamped"] == before + 1
    assert o["meta_info"]["finish_reason"] == {"type": "length", "length": ctx - len(prompt)}
    assert len(o["output_ids"]) == o["meta_info"]["completion_tokens"] == ctx - len(prompt)
    sampled = gen(st, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 100000, "n": 3, "sampling_seed": 1}})
    assert all(len(x["output_ids"]) <= ctx - len(prompt) for x in sampled)
    for p in ([1] * ctx, [1] * (ctx + 5000)):
        with pytest.raises(EngineHTTPError, match=rf"prompt 0 has {len(p)} tokens; the model's context is {ctx}") as e:
            gen(st, {"input_ids": p})
        assert e.value.status == 400


@pytest.mark.parametrize("body,msg", [
    ({"input_ids": [[1, 2]] * 5}, "at most --max-prompts-per-request 4"),
    ({"text": ["1+2="] * 5}, "at most --max-prompts-per-request 4"),
    ({"input_ids": [1, 2], "sampling_params": {"n": 4}}, r"\[1, 3\] \(--max-n\)"),
    ({"input_ids": [[1, 2]] * 4, "sampling_params": {"n": 3}}, "x n=3 = 12 samples"),  # 12 fit 16: answered
], ids=["prompts", "texts", "n", "within"])
def test_requests_over_the_limits_are_refused_naming_the_flag(bounded, body, msg):
    if msg.startswith("x n=3"):
        assert len(gen(bounded, {**body, "sampling_params": {"n": 3, "max_new_tokens": 2}})) == 12
        return
    with pytest.raises(EngineHTTPError, match=msg) as e:
        gen(bounded, body)
    assert e.value.status == 400


def held_request(st, rid: str):
    """Start a greedy 40-token request (no EOS on the way) and wait until the engine holds it at decode step 3."""
    st.engine.arm(3)
    fut = st.http.call_async(st.url, "/generate", {"input_ids": LONG_PROMPT, "rid": rid, "sampling_params": GREEDY_40},
                             timeout=60)
    wait_for(st.engine.reached.is_set, "the engine to reach decode step 3")
    return fut


def test_abort_request_stops_a_running_generation(bounded):
    st = bounded
    fut = held_request(st, "long")
    st.http.call(st.url, "/abort_request", {"rid": "long"}, timeout=30)
    st.engine.go.set()  # as SGLang, the engine answers an aborted running request at its next step, with its tokens
    out = fut.result(60)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    wait_for(lambda: not st.server._running, "the engine call to end")
    s = st.engine.last[0]
    assert s.finish_reason == "abort" and len(s.response_ids) < 40  # held at step 3 of a free run to 40
    assert out["output_ids"] == s.response_ids  # the partial output, as generated


def test_a_request_past_its_deadline_is_aborted_and_its_generation_stops(bounded):
    st = bounded
    st.server.cfg.request_timeout_s = 0.2
    try:
        before = st.server.stats["deadline_aborts"]
        fut = held_request(st, "slow")
        out = fut.result(60)  # the held engine cannot answer: the deadline does
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert "--request-timeout-s" in out["meta_info"]["finish_reason"]["message"]
        assert st.server.stats["deadline_aborts"] == before + 1
    finally:
        st.server.cfg.request_timeout_s = 300
        st.engine.go.set()
    wait_for(lambda: not st.server._running, "the engine call to end")
    assert st.engine.last[0].finish_reason == "abort" and len(st.engine.last[0].response_ids) < 40


def test_a_client_that_hangs_up_stops_its_generation(bounded):
    st = bounded
    before = st.server.stats["disconnects"]
    st.engine.arm(3)
    host, port = st.url.removeprefix("http://").split(":")
    body = json.dumps({"input_ids": LONG_PROMPT, "sampling_params": GREEDY_40}).encode()
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/generate", body=body, headers={"Content-Type": "application/json"})
    wait_for(st.engine.reached.is_set, "the engine to reach decode step 3")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_for(lambda: st.server.stats["disconnects"] == before + 1, "the server to see the client go")
    st.engine.go.set()
    wait_for(lambda: not st.server._running, "the engine call to end")
    assert st.engine.last[0].finish_reason == "abort" and len(st.engine.last[0].response_ids) < 40
