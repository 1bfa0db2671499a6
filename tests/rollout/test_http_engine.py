"""The HTTP engine against real `polyrl serve` processes: same samples as the embedded engine,
fault tolerance (kill -9 mid-rollout), a dead engine without it, the SGLang launch path through a
stand-in executable, and no orphan servers. Loopback only; every server is started by the test
(through the engine) and stopped by it; every wait is bounded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from polyrl.config import Config
from polyrl.rollout.embedded import EmbeddedEngine
from polyrl.rollout.http_engine import EngineDeadError, HTTPEngine
from polyrl.types import SamplingParams

pytestmark = pytest.mark.slow

# Both sides run the same FP32 transformers model on CPU, in different batch compositions (left padding,
# rows leaving the batch), so logits differ by BLAS reduction order only: a few ulp of fp32 (~1e-6 relative),
# i.e. logprob differences around 1e-6; 1e-4 leaves two orders of magnitude for any CPU's kernels.
LOGPROB_TOL = 1e-4


def engine_cfg(model: str, tmp_path, n: int = 2, **engines) -> Config:
    cfg = Config()
    cfg.model.hf_checkpoint = model
    cfg.cluster.device = "cpu"
    cfg.rollout.rollout_engine = "server"
    cfg.log.run_dir = str(tmp_path)
    e = cfg.engines
    e.rollout_num_engines = n
    e.rollout_engine_startup_timeout = 120
    e.rollout_request_timeout = 60
    e.rollout_health_check_interval = 0.5
    for k, v in engines.items():
        setattr(e, k, v)
    return cfg


def prompts(tok, k: int) -> list[list[int]]:
    return [tok(f"{a}+{a * 7 % 50}=")["input_ids"] for a in range(k)]


def same_samples(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g.group_index, g.prompt_ids, g.response_ids, g.finish_reason) == (w.group_index, w.prompt_ids, w.response_ids,
                                                                                   w.finish_reason)
        assert g.response == w.response
        assert max(abs(a - b) for a, b in zip(g.rollout_logprobs, w.rollout_logprobs)) < LOGPROB_TOL
        assert (g.top_logprobs is None) == (w.top_logprobs is None)
        for gp, wp in zip(g.top_logprobs or [], w.top_logprobs or []):  # SGLang's output_top_logprobs, read back
            assert len(gp) == len(wp) and max(abs(a[1] - b[1]) for a, b in zip(gp, wp)) < LOGPROB_TOL


@pytest.fixture(scope="module")
def two_servers(tiny_model, tmp_path_factory):
    eng = HTTPEngine(engine_cfg(tiny_model, tmp_path_factory.mktemp("two")), "cpu")
    try:
        yield eng
    finally:
        eng.close()


@pytest.mark.parametrize("sp", [
    SamplingParams(temperature=1.0, max_new_tokens=8, n=3, seed=7),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=8, n=2, seed=11),
    SamplingParams(temperature=0.0, max_new_tokens=6, n=1, seed=1),
    SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=3, stop=["1"], stop_token_ids=[5]),
    SamplingParams(temperature=0.9, max_new_tokens=6, n=2, seed=5, top_logprobs=3),
], ids=["sampled", "topk-topp", "greedy", "stops", "top-logprobs"])
def test_samples_equal_the_embedded_engine(two_servers, tiny_model, sp):
    ref = EmbeddedEngine(tiny_model, dtype=torch.float32)
    ps = prompts(ref.tokenizer, 6)
    want = ref.generate(ps, sp)
    same_samples(two_servers.generate(ps, sp), want)
    # one request per sample (what SGLang gets) gives the same samples as one request per prompt with n
    two_servers.split_samples = True
    try:
        same_samples(two_servers.generate(ps, sp), want)
    finally:
        two_servers.split_samples = False
    assert all(s.outstanding == 0 for s in two_servers.servers)


def test_kill_9_mid_rollout_with_fault_tolerance_loses_and_duplicates_nothing(tiny_model, tmp_path):
    ref = EmbeddedEngine(tiny_model, dtype=torch.float32)
    ps = prompts(ref.tokenizer, 24)
    sp = SamplingParams(temperature=1.0, max_new_tokens=24, n=4, seed=5)
    want = ref.generate(ps, sp)
    eng = HTTPEngine(engine_cfg(tiny_model, tmp_path, use_fault_tolerance=True), "cpu")
    try:
        victim = eng.servers[0]
        pid = victim.proc.pid
        out: dict = {}
        t = threading.Thread(target=lambda: out.setdefault("samples", eng.generate(ps, sp)))
        t.start()
        deadline = time.monotonic() + 30
        while victim.outstanding == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert victim.outstanding > 0, "engine 0 never got a request"
        os.kill(pid, signal.SIGKILL)
        t.join(120)
        assert not t.is_alive()
        # every (prompt, sample) exactly once, and the re-sent ones identical: seeds travel with the request
        same_samples(out["samples"], want)
        deadline = time.monotonic() + 90
        while not (victim.alive and victim.proc.pid != pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        stats = eng.stats()
        assert stats["rollout/retries"] >= 1 and stats["rollout/restarts"] == 1
        assert victim.alive and eng.membership == 1 and victim.version == 0  # no sync yet: initial weights are current
        same_samples(eng.generate(ps[:4], sp), want[:16])
    finally:
        eng.close()
    assert victim.proc.poll() is not None


def test_a_dead_engine_without_fault_tolerance_stops_the_run_naming_it(tiny_model, tmp_path):
    eng = HTTPEngine(engine_cfg(tiny_model, tmp_path, n=1), "cpu")
    try:
        eng.servers[0].proc.kill()
        eng.servers[0].proc.wait(10)
        with pytest.raises(EngineDeadError, match=r"engine 0 \(http://127\.0\.0\.1:\d+, log .*engine0\.log\)"):
            eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, seed=0))
    finally:
        eng.close()


FAKE_SGLANG = '''
"""Stand-in for `python -m sglang.launch_server`: records its argv, then runs polyrl serve with the flags both share
(the key from SGLang's YAML --config file; weights from the directory --weight-sync disk writes in)."""
import json, os, stat, sys, yaml
from polyrl.weight_sync.distributed import private_weight_dir
argv = sys.argv[1:]
with open(os.environ["FAKE_SGLANG_ARGV"], "a") as f:
    f.write(json.dumps(argv) + "\\n")
keep = {"--model-path": "--hf-checkpoint", "--host": "--host", "--port": "--port"}
out = []
for i, a in enumerate(argv):
    if a in keep:
        out += [keep[a], argv[i + 1]]
config = argv[argv.index("--config") + 1]
assert stat.S_IMODE(os.stat(config).st_mode) == 0o600, oct(os.stat(config).st_mode)
os.environ["POLYRL_API_KEY"] = yaml.safe_load(open(config))["api-key"]
os.execv(sys.executable, [sys.executable, "-m", "polyrl", "serve", "--device", "cpu", "--allowed-weight-dirs",
                          private_weight_dir(), *out])
'''


def install_fake_sglang(tmp_path, monkeypatch) -> None:
    """FAKE_SGLANG as the `sglang` package of this process and of the servers it launches; its argv goes to
    tmp_path/argv.jsonl."""
    pkg = tmp_path / "fake" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(textwrap.dedent(FAKE_SGLANG))
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("FAKE_SGLANG_ARGV", str(tmp_path / "argv.jsonl"))


def test_sglang_launch_path_passes_every_sglang_flag(tiny_model, arith_data, tmp_path, monkeypatch):
    from polyrl.cli import main
    install_fake_sglang(tmp_path, monkeypatch)
    args = ["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--rm-type", "arithmetic",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--num-rollout", "1",
            "--quiet", "--device", "cpu", "--run-dir", str(tmp_path / "run"), "--rollout-engine", "sglang",
            "--rollout-num-engines", "1", "--api-key", "k3y", "--weight-sync", "disk",
            "--sglang-tp-size", "1", "--sglang-dp-size", "1", "--sglang-mem-fraction-static", "0.5",
            "--sglang-enable-torch-compile", "--sglang-speculative-algorithm", "EAGLE",
            "--sglang-speculative-num-draft-tokens", "4", "--sglang-enable-deterministic-inference", "--sglang-some-new-flag=x"]
    assert main(args) == 0
    argv = json.loads((tmp_path / "argv.jsonl").read_text().splitlines()[0])
    assert argv[:2] == ["--model-path", tiny_model] and "--api-key" not in argv and "k3y" not in argv
    assert not list((tmp_path / "run" / "engines").glob("*.yaml"))  # the key's file is gone with the run
    tail = " ".join(argv)
    for want in ("--tp-size 1", "--dp-size 1", "--mem-fraction-static 0.5", "--enable-torch-compile",
                 "--speculative-algorithm EAGLE", "--speculative-num-draft-tokens 4", "--enable-deterministic-inference",
                 "--some-new-flag=x"):
        assert want in tail, want
    assert json.loads(open(tmp_path / "run" / "metrics.jsonl").readline())["step"] == 1


def test_sglang_missing_is_a_clear_error(tiny_model, arith_data, tmp_path, capsys):
    import importlib.util
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is installed here")
    from polyrl.cli import main
    code = main(["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--rm-type", "arithmetic",
                 "--device", "cpu", "--quiet", "--run-dir", str(tmp_path), "--rollout-engine", "sglang"])
    assert code == 2 and "pip install" in capsys.readouterr().err


def _servers_of(model: str) -> list[int]:
    """pids of `polyrl serve` processes for this model directory."""
    pids = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if b"serve" in cmd and model.encode() in cmd:
            pids.append(int(pid))
    return pids


def _wait(cond, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.2)
    return cond()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_no_orphan_servers_when_the_trainer_is_killed(tmp_path, arith_data):
    from conftest import make_model_dir
    model = make_model_dir(tmp_path / "m")  # its own path, so only this test's servers match
    cmd = [sys.executable, "-m", "polyrl", "train", "--hf-checkpoint", model, "--prompt-data", arith_data["train"],
           "--rm-type", "arithmetic", "--device", "cpu", "--quiet", "--run-dir", str(tmp_path / "run"),
           "--rollout-engine", "server", "--rollout-num-engines", "2", "--num-rollout", "1000"]
    trainer = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert _wait(lambda: os.path.exists(tmp_path / "run" / "metrics.jsonl"), 180), "the run never logged a step"
        assert len(_servers_of(model)) == 2
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(30)
        assert _wait(lambda: not _servers_of(model), 30), "servers outlived their trainer"
    finally:
        trainer.kill()
        for pid in _servers_of(model):
            os.kill(pid, signal.SIGKILL)


RECORDER = '''
import json, os
def record(sample):
    with open(os.environ["POLYRL_TEST_SAMPLES"], "a") as f:
        f.write(json.dumps([sample.prompt_ids, sample.response_ids, sample.rollout_logprobs, sample.finish_reason]) + "\\n")
    return sum(c.isdigit() for c in sample.response) / 8.0
'''


def _grpo(tiny_model, arith_data, tmp_path, monkeypatch, name: str, *extra: str) -> tuple[list, list]:
    from polyrl.cli import main
    rm = tmp_path / "rm.py"
    rm.write_text(RECORDER)
    monkeypatch.setenv("POLYRL_TEST_SAMPLES", str(tmp_path / f"{name}.jsonl"))
    run = tmp_path / name
    assert main(["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--custom-rm-path", f"{rm}:record",
                 "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6", "--lr", "1e-3",
                 "--num-rollout", "3", "--quiet", "--seed", "3", "--device", "cpu", "--run-dir", str(run), *extra]) == 0
    samples = [json.loads(l) for l in open(tmp_path / f"{name}.jsonl")]
    return samples, [json.loads(l) for l in open(run / "metrics.jsonl")]


def test_grpo_through_two_servers_equals_the_embedded_engine(tiny_model, arith_data, tmp_path, monkeypatch):
    want, want_m = _grpo(tiny_model, arith_data, tmp_path, monkeypatch, "embedded")
    for name, extra in (("servers", ()), ("router", ("--use-sglang-router",))):
        got, got_m = _grpo(tiny_model, arith_data, tmp_path, monkeypatch, name, "--rollout-engine", "server",
                           "--rollout-num-engines", "2", "--check-weight-update-equal", *extra)
        assert len(got) == len(want) == 3 * 16
        for g, w in zip(got, want):  # same tokens and finish reasons at every step: seeds travel with the requests
            assert (g[0], g[1], g[3]) == (w[0], w[1], w[3])
            assert max(abs(a - b) for a, b in zip(g[2], w[2])) < LOGPROB_TOL
        for gm, wm in zip(got_m, want_m):
            assert gm["reward/mean"] == wm["reward/mean"]
            # weights reach the servers exactly (gloo broadcast of fp32): their logprobs match the trainer's
            assert gm["train_rollout_logprob_abs_diff"] < LOGPROB_TOL
            assert gm["loss"] == pytest.approx(wm["loss"], rel=1e-3, abs=1e-5)
        assert got_m[-1]["rollout/engines_up"] == 2


def test_sglang_launch_with_fp8_rollout_starts_on_a_block_fp8_copy(tiny_model, arith_data, tmp_path, monkeypatch):
    """--rollout-quantization fp8 with a launched SGLang: its --model-path is a block-FP8 copy of the checkpoint
    (config.json's quantization_config as HF FP8 checkpoints and SGLang's Fp8Config read it; every linear weight FP8
    with its weight_scale_inv, the rest as they were, the tokenizer beside them), which the stand-in serves
    (polyrl serve loads it dequantized); the quantized weight stream then reaches it and training runs."""
    from safetensors.torch import load_file

    from polyrl.cli import main
    from polyrl.weight_sync.quantize import FP8_DTYPE, QUANTIZATION_CONFIG, dequantize_fp8_block, is_quantized_weight
    install_fake_sglang(tmp_path, monkeypatch)
    run = tmp_path / "run"
    assert main(["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--rm-type", "arithmetic",
                 "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
                 "--num-rollout", "2", "--quiet", "--device", "cpu", "--run-dir", str(run), "--rollout-engine", "sglang",
                 "--rollout-num-engines", "1", "--weight-sync", "disk", "--rollout-quantization", "fp8",
                 "--rollout-mem-fraction", "0.3"]) == 0
    argv = json.loads((tmp_path / "argv.jsonl").read_text().splitlines()[0])
    copy = run / "engines" / "fp8-checkpoint"
    assert argv[:2] == ["--model-path", str(copy)]
    assert "--mem-fraction-static 0.3" in " ".join(argv)  # --rollout-mem-fraction reaches SGLang
    conf = json.loads((copy / "config.json").read_text())
    assert conf["quantization_config"] == QUANTIZATION_CONFIG
    assert (copy / "tokenizer.json").exists() or (copy / "tokenizer_config.json").exists()
    src, got = load_file(os.path.join(tiny_model, "model.safetensors")), load_file(str(copy / "model.safetensors"))
    quantized = [n for n, t in src.items() if is_quantized_weight(n, t)]
    assert quantized and set(got) == set(src) | {n[:-len(".weight")] + ".weight_scale_inv" for n in quantized}
    for n, t in src.items():
        if n in quantized:  # E4M3 keeps 3 mantissa bits of each block's values scaled onto 448: relative error <= 2^-4
            assert got[n].dtype == FP8_DTYPE
            back = dequantize_fp8_block(got[n], got[n[:-len(".weight")] + ".weight_scale_inv"]).float()
            assert torch.allclose(back, t.float(), rtol=2**-4, atol=t.abs().max().item() * 2**-9 + 1e-12)
        else:
            assert torch.equal(got[n], t)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # the server samples from FP8-rounded weights, the trainer scores with its own: a gap, but a bounded one
    assert len(rows) == 2 and all(0 < r["train_rollout_logprob_abs_diff"] < 0.5 for r in rows), rows


def test_a_launched_server_that_lost_its_port_starts_again_on_another(tiny_model, arith_data, tmp_path, monkeypatch,
                                                                       caplog):
    """The port free_port() picks can be taken by another process before the launched server binds it (seen in `make
    test`: a `polyrl serve` exited "port ... is already in use"). Here the first port handed out is held by a listening
    socket: that server exits saying so, the engine starts it again on the next port, and the run completes; its log
    keeps both starts."""
    import socket

    from polyrl.cli import main
    from polyrl.dist import free_port as real_free_port
    from polyrl.rollout import http_engine

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    ports = [held.getsockname()[1]]
    monkeypatch.setattr(http_engine, "free_port", lambda: ports.pop(0) if ports else real_free_port())
    args = ["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--rm-type", "arithmetic",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--num-rollout", "1",
            "--quiet", "--device", "cpu", "--run-dir", str(tmp_path / "run"), "--rollout-engine", "server",
            "--rollout-num-engines", "1", "--debug-rollout-only"]
    try:
        with caplog.at_level("WARNING", logger="polyrl.rollout.http_engine"):
            assert main(args) == 0
    finally:
        held.close()
    assert not ports  # the held port was handed out
    assert any("port was taken" in r.getMessage() for r in caplog.records)
    log = (tmp_path / "run" / "engines" / "engine0.log").read_text()
    assert "already in use" in log and "listening on" in log
