"""Fault tolerance of the HTTP engine against real `polyrl serve` processes it launches (CPU, loopback):
a single engine killed mid-rollout, killed during a weight sync, or hung (SIGSTOP) is restarted and
re-sent the current weights, and every prompt's samples come back exactly once, equal to an in-process
engine holding the same weights; two engines killed together; without --use-fault-tolerance a death
during a sync or a hang is one EngineDeadError naming the engine and its log. Assertions are on
samples, counters and processes; time appears only in the bounded waits."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from polyrl.rollout.embedded import EmbeddedEngine
from polyrl.rollout.http_engine import EngineDeadError, HTTPEngine
from polyrl.types import SamplingParams
from polyrl.weight_sync.distributed import DistributedTransport
from tests.rollout.test_http_engine import engine_cfg as http_engine_cfg

pytestmark = pytest.mark.slow

# Same FP32 model on both sides, different batch compositions: logprobs differ by BLAS reduction order only
# (~1e-6); 1e-4 leaves two orders of magnitude (as in test_http_engine).
LOGPROB_TOL = 1e-4


def engine_cfg(model: str, tmp_path, n: int, fault_tolerant: bool):
    # a hung server's requests give up after 10 s (the health check is faster)
    return http_engine_cfg(model, tmp_path, n, use_fault_tolerance=fault_tolerant, rollout_engine_startup_timeout=180,
                           rollout_request_timeout=10)


def trainer_weights(model_dir: str, step: int) -> dict[str, torch.Tensor]:
    """The tiny model's weights moved by a step-dependent amount: what a trained step would push."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(step)
    return {n: p.detach() + 0.01 * step * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def reference(model: str, weights: dict | None, version: int, ps, sp):
    ref = EmbeddedEngine(model, dtype=torch.float32)
    if weights is not None:
        ref.update_weights(iter(weights.items()), version)
    return ref.generate(ps, sp)


def prompts(eng: HTTPEngine, k: int) -> list[list[int]]:
    return [eng.tokenizer(f"{a}+{a * 7 % 50}=")["input_ids"] for a in range(k)]


def same_samples(got, want) -> None:
    """Every (prompt, sample) exactly once, in order, with the reference's tokens: none lost, none duplicated."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g.group_index, g.prompt_ids, g.response_ids, g.finish_reason) == (w.group_index, w.prompt_ids,
                                                                                   w.response_ids, w.finish_reason)
        assert max(abs(a - b) for a, b in zip(g.rollout_logprobs, w.rollout_logprobs)) < LOGPROB_TOL


def wait_for(cond, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, f"waited {seconds:.0f} s for {what}"
        time.sleep(0.05)


def generate_while(eng: HTTPEngine, ps, sp, victims: list[int], sig: int) -> list:
    """generate() on a thread; once every victim server has a request in flight, send it `sig`. Returns the samples.
    The victims are stopped (SIGSTOP) before the call, so their requests stay in flight however fast the tiny model
    answers: the signal always lands mid-rollout (a stopped server is what a hung one looks like)."""
    out: dict = {}
    for k in victims:
        os.kill(eng.servers[k].proc.pid, signal.SIGSTOP)
    t = threading.Thread(target=lambda: out.setdefault("samples", eng.generate(ps, sp)), daemon=True)
    t.start()
    for k in victims:
        s = eng.servers[k]
        wait_for(lambda: s.outstanding > 0, 60, f"engine {k} to get a request")
        if sig != signal.SIGSTOP:
            os.kill(s.proc.pid, sig)
    t.join(400)
    assert not t.is_alive(), "generate did not return"
    assert "samples" in out, "generate raised (see the log above)"
    return out["samples"]


def restarted(s, old) -> bool:
    return s.alive and s.proc is not old and not s.restarting


def killing_stream(weights: dict, proc, after: int):
    """The weights as a push streams them, killing the server (kill -9) once `after` tensors went out."""
    for k, item in enumerate(weights.items()):
        if k == after:
            proc.kill()
            proc.wait(10)
        yield item


def test_one_engine_survives_a_kill_a_kill_during_the_sync_and_a_hang(tiny_model, tmp_path):
    eng = HTTPEngine(engine_cfg(tiny_model, tmp_path, 1, fault_tolerant=True), "cpu")
    tr = DistributedTransport(1 << 14, device="cpu", timeout_s=120)  # small buckets: a push takes several
    s = eng.servers[0]
    try:
        ps = prompts(eng, 8)
        sp = SamplingParams(temperature=1.0, max_new_tokens=16, n=2, seed=5)
        w1 = trainer_weights(tiny_model, 1)
        tr.push(iter(w1.items()), eng, 1)
        eng.stats()

        # 1. kill -9 mid-rollout: restarted with --hf-checkpoint's weights, re-sent v1, then the requests go to it
        old = s.proc
        same_samples(generate_while(eng, ps, sp, [0], signal.SIGKILL), reference(tiny_model, w1, 1, ps, sp))
        st = eng.stats()
        # >= 1: on a loaded CPU a health check may also time out on a busy healthy server (samples stay exact)
        assert st["rollout/restarts"] >= 1 and st["rollout/resyncs"] >= 1 and st["rollout/retries"] >= 1
        assert s.proc is not old and s.version == 1 and eng.membership >= 1

        # 2. kill -9 during the push of v2: the push completes (no server left to take it), the restarted
        # server gets v2 alone, and the next rollout samples from v2
        w2 = trainer_weights(tiny_model, 2)
        old = s.proc
        tr.push(killing_stream(w2, old, len(w2) // 2), eng, 2)
        assert old.returncode == -signal.SIGKILL and eng.version == 2
        wait_for(lambda: restarted(s, old), 240, "the engine killed during the sync to come back")
        assert s.version == 2
        same_samples(eng.generate(ps, sp), reference(tiny_model, w2, 2, ps, sp))
        st = eng.stats()
        assert st["rollout/restarts"] >= 1 and st["rollout/resyncs"] >= 1

        # 3. SIGSTOP mid-rollout: the health check (or the request timeout) finds it hung, it is killed with
        # SIGKILL (SIGTERM waits for a stopped process) and restarted, its requests answered once, by the new one
        old = s.proc
        same_samples(generate_while(eng, ps, sp, [0], signal.SIGSTOP), reference(tiny_model, w2, 2, ps, sp))
        assert old.returncode == -signal.SIGKILL
        st = eng.stats()
        assert st["rollout/restarts"] >= 1 and st["rollout/resyncs"] >= 1 and st["rollout/engines_lost"] >= 1
        assert s.version == 2 and tr.builds >= 2  # the next push rebuilds the group with the new process
        tr.push(iter(w1.items()), eng, 3)
        assert s.version == 3
    finally:
        tr.close()
        eng.close()


def test_two_engines_both_killed_then_one_hung(tiny_model, tmp_path):
    eng = HTTPEngine(engine_cfg(tiny_model, tmp_path, 2, fault_tolerant=True), "cpu")
    tr = DistributedTransport(1 << 20, device="cpu", timeout_s=120)
    try:
        ps = prompts(eng, 12)
        sp = SamplingParams(temperature=1.0, max_new_tokens=16, n=2, seed=9)
        w1 = trainer_weights(tiny_model, 1)
        tr.push(iter(w1.items()), eng, 1)
        want = reference(tiny_model, w1, 1, ps, sp)
        eng.stats()
        olds = [s.proc for s in eng.servers]
        same_samples(generate_while(eng, ps, sp, [0, 1], signal.SIGKILL), want)
        for s, old in zip(eng.servers, olds):
            wait_for(lambda: restarted(s, old), 240, f"{s.name} to come back")
            assert s.version == 1
        st = eng.stats()
        assert st["rollout/restarts"] >= 2 and st["rollout/resyncs"] >= 2

        victim, other = eng.servers
        old = victim.proc
        same_samples(generate_while(eng, ps, sp, [0], signal.SIGSTOP), want)
        wait_for(lambda: restarted(victim, old), 240, "the hung engine to come back")
        assert old.returncode == -signal.SIGKILL and victim.version == 1
        st = eng.stats()
        assert st["rollout/restarts"] >= 1 and st["rollout/retries"] >= 1
    finally:
        tr.close()
        eng.close()


def test_without_fault_tolerance_a_death_during_the_sync_or_a_hang_names_the_engine(tiny_model, tmp_path):
    name = r"engine 0 \(http://127\.0\.0\.1:\d+, log [^)]*engine0\.log\)"
    eng = HTTPEngine(engine_cfg(tiny_model, tmp_path / "a", 1, fault_tolerant=False), "cpu")
    tr = DistributedTransport(1 << 14, device="cpu", timeout_s=120)
    try:
        w = trainer_weights(tiny_model, 1)
        with pytest.raises(EngineDeadError, match=name + " exited with code -9 during the weight sync") as err:
            tr.push(killing_stream(w, eng.servers[0].proc, len(w) // 2), eng, 1)
        assert "\n" not in str(err.value)  # one line, as the CLI prints it
    finally:
        tr.close()
        eng.close()

    eng = HTTPEngine(engine_cfg(tiny_model, tmp_path / "b", 1, fault_tolerant=False), "cpu")
    s = eng.servers[0]
    try:
        ps = prompts(eng, 8)
        out: dict = {}

        def run():
            try:
                eng.generate(ps, SamplingParams(temperature=1.0, max_new_tokens=16, n=2, seed=5))
            except EngineDeadError as e:
                out["error"] = e
        os.kill(s.proc.pid, signal.SIGSTOP)  # hung before the call: its requests stay in flight however fast the model
        t = threading.Thread(target=run, daemon=True)
        t.start()
        wait_for(lambda: s.outstanding > 0, 60, "engine 0 to get a request")
        t.join(120)
        assert not t.is_alive(), "generate did not stop on a hung engine"
        assert "error" in out
        assert re.search(name + " failed: .*(marked down|no answer within)", str(out["error"]))
        assert not s.alive and "rollout/restarts" not in eng.stats()  # nothing restarted without the flag
    finally:
        eng.close()
    assert s.proc.returncode is not None


KILLER = '''
import os, signal
def reward(sample):
    """Kills the run's one engine server (kill -9) at the first reward of step 2: after that step's rollout,
    before its weight sync. The reward itself: the share of digits in the response."""
    n = int(open(os.environ["POLYRL_TEST_CALLS"]).read() or 0) if os.path.exists(os.environ["POLYRL_TEST_CALLS"]) else 0
    with open(os.environ["POLYRL_TEST_CALLS"], "w") as f:
        f.write(str(n + 1))
    if n == int(os.environ["POLYRL_TEST_KILL_AT"]):
        for pid in os.listdir("/proc"):
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
            except OSError:
                continue
            if b"serve" in cmd and os.environ["POLYRL_TEST_MODEL"].encode() in cmd:
                os.kill(int(pid), signal.SIGKILL)
    return sum(c.isdigit() for c in sample.response) / 8.0
'''


def test_train_with_one_engine_survives_its_kill_and_samples_from_the_trainer_weights(tmp_path, arith_data, monkeypatch):
    """`polyrl train --rollout-num-engines 1 --use-fault-tolerance`: the engine killed between a rollout and the
    weight sync is restarted and gets the weights; every step's rollout logprobs equal the trainer's (the engine
    holds the trainer's weights at every step), and the run finishes."""
    import json
    from conftest import make_model_dir
    from polyrl.cli import main
    model = make_model_dir(tmp_path / "m")  # its own path: only this run's server matches the killer
    rm = tmp_path / "rm.py"
    rm.write_text(KILLER)
    monkeypatch.setenv("POLYRL_TEST_CALLS", str(tmp_path / "calls"))
    monkeypatch.setenv("POLYRL_TEST_KILL_AT", "16")  # rollout batch 4 x 4 samples: the 17th reward is step 2's first
    monkeypatch.setenv("POLYRL_TEST_MODEL", model)
    run = tmp_path / "run"
    assert main(["train", "--hf-checkpoint", model, "--prompt-data", arith_data["train"], "--custom-rm-path", f"{rm}:reward",
                 "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6",
                 "--lr", "1e-3", "--num-rollout", "3", "--quiet", "--seed", "3", "--device", "cpu", "--run-dir", str(run),
                 "--rollout-engine", "server", "--rollout-num-engines", "1", "--use-fault-tolerance",
                 "--rollout-health-check-interval", "0.5", "--rollout-request-timeout", "30"]) == 0
    rows = [json.loads(l) for l in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert sum(r.get("rollout/restarts", 0) for r in rows) >= 1
    for r in rows:  # gloo moves fp32 exactly; the rest is BLAS reduction order (see LOGPROB_TOL)
        assert r["train_rollout_logprob_abs_diff"] < LOGPROB_TOL, r


def test_two_engines_one_killed_during_the_sync(tiny_model, tmp_path):
    """The other server gets the whole push; the killed one comes back with it; both sample from it."""
    eng = HTTPEngine(engine_cfg(tiny_model, tmp_path, 2, fault_tolerant=True), "cpu")
    tr = DistributedTransport(1 << 14, device="cpu", timeout_s=60)
    try:
        w1 = trainer_weights(tiny_model, 1)
        victim, other = eng.servers
        old = victim.proc
        tr.push(killing_stream(w1, old, len(w1) // 2), eng, 1)
        assert old.returncode == -signal.SIGKILL and other.version == 1
        wait_for(lambda: restarted(victim, old), 240, "the engine killed during the sync to come back")
        assert victim.version == 1
        ps = prompts(eng, 8)
        sp = SamplingParams(temperature=1.0, max_new_tokens=16, n=2, seed=5)
        same_samples(eng.generate(ps, sp), reference(tiny_model, w1, 1, ps, sp))
        st = eng.stats()
        assert st["rollout/restarts"] >= 1 and st["rollout/resyncs"] >= 1
        assert all(s.outstanding == 0 for s in eng.servers)
    finally:
        tr.close()
        eng.close()


def test_a_killed_router_is_restarted_with_fault_tolerance_and_named_without_it(tiny_model, tmp_path, capsys):
    """kill -9 of the sglang-router: with --use-fault-tolerance it is started again on its port (the engine is alive)
    and the rollout goes on with the same samples; without it the error is one line naming the router and its log.
    While the servers and the router start, one line says what is waited for."""
    pytest.importorskip("sglang_router")
    cfg = engine_cfg(tiny_model, tmp_path / "ft", 1, fault_tolerant=True)
    cfg.engines.use_sglang_router = True
    eng = HTTPEngine(cfg, "cpu")
    said = capsys.readouterr().err
    assert said.count("waiting for") == 1 and re.search(
        r"polyrl: waiting for 1 engine server \(http://127\.0\.0\.1:\d+; logs in [^)]*engines\) and the sglang-router "
        r"to answer /health, up to 180 s \(--rollout-engine-startup-timeout\)", said), said
    try:
        ps = prompts(eng, 6)
        sp = SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=5)
        want = reference(tiny_model, None, 0, ps, sp)
        same_samples(eng.generate(ps, sp), want)
        old = eng.router
        old.proc.kill()
        old.proc.wait(10)
        same_samples(eng.generate(ps, sp), want)
        assert eng.router is not old and eng.router.url == old.url and eng.router.proc.poll() is None
        assert eng.stats()["rollout/router_restarts"] == 1
    finally:
        eng.close()

    cfg = engine_cfg(tiny_model, tmp_path / "no_ft", 1, fault_tolerant=False)
    cfg.engines.use_sglang_router = True
    eng = HTTPEngine(cfg, "cpu")
    try:
        eng.router.proc.kill()
        eng.router.proc.wait(10)
        with pytest.raises(EngineDeadError, match=r"sglang-router \(http://127\.0\.0\.1:\d+, log [^)]*router\.log\) "
                                                  r"exited with code -9") as err:
            eng.generate(prompts(eng, 2), SamplingParams(temperature=1.0, max_new_tokens=4, n=1, seed=5))
        assert "\n" not in str(err.value) and str(tmp_path / "no_ft" / "engines" / "router.log") in str(err.value)
    finally:
        eng.close()


ROUTER_KILLER = '''
import os, signal
def reward(sample):
    """Kills this run's sglang-router (kill -9; a child of this process) at the first reward of step 2."""
    n = int(open(os.environ["POLYRL_TEST_CALLS"]).read() or 0) if os.path.exists(os.environ["POLYRL_TEST_CALLS"]) else 0
    with open(os.environ["POLYRL_TEST_CALLS"], "w") as f:
        f.write(str(n + 1))
    if n == int(os.environ["POLYRL_TEST_KILL_AT"]):
        for pid in os.listdir("/proc"):
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read()
                ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == os.getpid() and cmd.startswith(b"sglang::router"):  # the router sets this process title
                os.kill(int(pid), signal.SIGKILL)
    return sum(c.isdigit() for c in sample.response) / 8.0
'''


def test_train_without_fault_tolerance_names_the_dead_router_its_log_and_the_latest_checkpoint(tmp_path, arith_data,
                                                                                             monkeypatch, capsys):
    """kill -9 of the sglang-router after step 1's checkpoint: the run stops at the next rollout with one line naming
    the router, its log and the latest complete checkpoint."""
    pytest.importorskip("sglang_router")
    from conftest import make_model_dir
    from polyrl.cli import main
    model = make_model_dir(tmp_path / "m")
    rm = tmp_path / "rm.py"
    rm.write_text(ROUTER_KILLER)
    monkeypatch.setenv("POLYRL_TEST_CALLS", str(tmp_path / "calls"))
    monkeypatch.setenv("POLYRL_TEST_KILL_AT", "4")  # rollout batch 2 x 2 samples: the 5th reward is step 2's first
    run, save = tmp_path / "run", tmp_path / "save"
    assert main(["train", "--hf-checkpoint", model, "--prompt-data", arith_data["train"], "--custom-rm-path", f"{rm}:reward",
                 "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
                 "--num-rollout", "3", "--quiet", "--seed", "3", "--device", "cpu", "--run-dir", str(run),
                 "--save", str(save), "--save-interval", "1", "--rollout-engine", "server", "--rollout-num-engines", "1",
                 "--use-sglang-router", "--rollout-health-check-interval", "0.5"]) == 1
    line = [x for x in capsys.readouterr().err.splitlines() if x.startswith("polyrl train: error:")]
    assert len(line) == 1, line
    assert re.search(r"error: sglang-router \(http://127\.0\.0\.1:\d+, log [^)]*router\.log\) exited with code -9", line[0])
    assert str(run / "engines" / "router.log") in line[0] and "step 3" in line[0], line[0]
    assert re.search(r"latest complete checkpoint: \S*step_0*2\b", line[0]), line[0]
