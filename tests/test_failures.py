"""The failures a user meets, each handled: runs that cannot learn refused at start-up, steps whose rewards all fail or
all score 0 warned about (and stopped with --max-consecutive-failed-steps), the train/rollout log-prob gate, used run
directories, Ctrl-C and SIGTERM, busy ports, torn or tampered checkpoints, and secrets kept out of what a run writes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from polyrl.cli import build_parser, main
from polyrl.config import config_from_args, validate


def _base(tiny_model, data, run, *extra):
    return ["train", "--hf-checkpoint", tiny_model, "--prompt-data", data, "--quiet", "--device", "cpu",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
            "--run-dir", str(run), *extra]


def _rows(run):
    return [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]


def _write_rm(tmp_path, body: str) -> str:
    rm = tmp_path / "rm.py"
    rm.write_text(body)
    return f"{rm}:reward"


# ---- runs that cannot learn: refused before anything starts (exit 2, naming the flags) ----

@pytest.mark.parametrize("argv, needle", [
    *[(["--rm-type", "arithmetic", "--n-samples-per-prompt", "1", "--advantage-estimator", est],
       f"--n-samples-per-prompt 1 with --advantage-estimator {est}")
      for est in ("grpo", "gspo", "dr_grpo", "reinforce_plus_plus_baseline")],
    (["--rm-type", "arithmetic", "--rollout-temperature", "0"], "--rollout-temperature 0 (greedy) with --advantage-estimator grpo"),
    (["--rm-type", "arithmetic", "--custom-rm-path", "polyrl.rewards:exact_match"], "--rm-type arithmetic and --custom-rm-path"),
    (["--rm-type", "arithmetic", "--eval-prompt-data", "EVAL"], "add --eval-interval N"),
    (["--rm-type", "arithmetic", "--eval-interval", "2"], "--eval-interval 2 has no prompts to evaluate on"),
    (["--rm-type", "arithmetic", "--save-hf", "MODEL"], "is the --hf-checkpoint directory"),
    (["--rm-type", "arithmetic", "--ref-load", "MODEL", "--save-hf", "LINK"], "is the --hf-checkpoint directory"),
    (["--rm-type", "arithmetic", "--ci-train-rollout-logprob-abs-diff-threshold", "0.1", "--debug-rollout-only"],
     "--debug-rollout-only trains nothing"),
])
def test_runs_that_cannot_learn_exit_2_naming_the_flags(argv, needle, tiny_model, arith_data, tmp_path, capsys):
    link = tmp_path / "link"
    os.symlink(tiny_model, link)  # the same directory under another name: compared by realpath
    subst = {"EVAL": arith_data["eval"], "MODEL": tiny_model, "LINK": str(link)}
    argv = [subst.get(a, a) for a in argv]
    assert main(_base(tiny_model, arith_data["train"], tmp_path / "run", *argv)) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv, needle", [
    (["eval", "--rm-type", "arithmetic", "--custom-rm-path", "polyrl.rewards:exact_match"], "both choose the reward"),
    (["eval", "--rm-type", "arithmetic", "--overwrite"], "--overwrite"),
    (["eval", "--rm-type", "arithmetic", "--max-consecutive-failed-steps", "2"], "--max-consecutive-failed-steps"),
    (["sft", "--ci-train-rollout-logprob-abs-diff-threshold", "0.1"], "polyrl sft trains no policy"),
    (["export-hf", "--load", "CK", "--save-hf", "MODEL"], "is the --hf-checkpoint directory"),
])
def test_other_commands_refuse_what_they_would_ignore_or_overwrite(argv, needle, tiny_model, arith_data, tmp_path, capsys):
    os.makedirs(tmp_path / "ck")
    argv = [{"CK": str(tmp_path / "ck"), "MODEL": tiny_model}.get(a, a) for a in argv]
    data = ["--prompt-data", arith_data["train"], "--run-dir", str(tmp_path / "run")] if argv[0] != "export-hf" else []
    assert main([argv[0], "--hf-checkpoint", tiny_model, *data, *argv[1:]]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["--n-samples-per-prompt", "1", "--advantage-estimator", "reinforce_plus_plus"],  # normalized over the batch
    ["--n-samples-per-prompt", "1", "--custom-generate-function-path", "examples/tool_calculator/calculator.py:generate"],
    ["--rollout-temperature", "0", "--debug-rollout-only"],  # trains nothing
    ["--eval-prompt-data", "", "--eval-interval", "0"],  # a --config file's eval set turned off
])
def test_runs_that_can_learn_still_validate(argv, tiny_model, arith_data, monkeypatch):
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    args, _ = build_parser().parse_known_args(["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"],
                                               "--rm-type", "arithmetic", *argv])
    validate(config_from_args(args), "train")


# ---- rewards that all fail or all score 0: warned at the step, counted, stopped after N in a row ----

def test_every_reward_call_failing_is_warned_counted_and_stops_after_n_steps(tiny_model, arith_data, tmp_path, capsys):
    rm = _write_rm(tmp_path, "def reward(sample):\n    raise ValueError('no label here')\n")
    run = tmp_path / "run"
    assert main(_base(tiny_model, arith_data["train"], run, "--custom-rm-path", rm, "--num-rollout", "5",
                      "--max-consecutive-failed-steps", "2")) == 1
    err = capsys.readouterr().err
    assert "WARNING step 1: every reward call failed (4 errors, 0 timeouts" in err and "1 of --max-consecutive-failed-steps 2" in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("polyrl train: error: step 2: every reward call failed") and "--max-consecutive-failed-steps 2" in last
    rows = _rows(run)  # the stopping step's row is written before the run stops
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["reward/all_failed"] == 1.0 and r["reward/errors"] == 4.0 and r["reward/samples"] == 4.0 for r in rows)


def test_all_zero_rewards_are_warned_and_a_good_step_resets_the_count(tiny_model, arith_data, tmp_path, capsys):
    # step 1 (rollout_id 0 in the prompt order) scores 0 everywhere, later steps score 1 for group 0: the warning names
    # step 1 only, and --max-consecutive-failed-steps 2 never trips
    rm = _write_rm(tmp_path, "calls = [0]\ndef reward(sample):\n    calls[0] += 1\n"
                             "    return 0.0 if calls[0] <= 4 else float(sample.group_index == 0)\n")
    run = tmp_path / "run"
    assert main(_base(tiny_model, arith_data["train"], run, "--custom-rm-path", rm, "--num-rollout", "3",
                      "--max-consecutive-failed-steps", "2")) == 0
    err = capsys.readouterr().err
    assert "WARNING step 1: every reward is 0" in err and "WARNING step 2" not in err and "WARNING step 3" not in err
    rows = _rows(run)
    assert [(r["reward/all_zero"], r["reward/all_failed"]) for r in rows] == [(1.0, 0.0), (0.0, 0.0), (0.0, 0.0)]


def test_the_console_step_line_shows_the_reward_error_count(tiny_model, arith_data, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # rich wraps the step line at the console width
    rm = _write_rm(tmp_path, "def reward(sample):\n    if sample.group_index == 0:\n        raise RuntimeError('boom')\n"
                             "    return 1.0\n")
    argv = [a for a in _base(tiny_model, arith_data["train"], tmp_path / "run", "--custom-rm-path", rm, "--num-rollout", "1")
            if a != "--quiet"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "step 1 |" in out and "rerr 2" in out  # group 0's 2 samples failed


# ---- the fail-closed gate on the train/rollout log-prob difference ----

@pytest.fixture
def skewed_rollout_logprobs(monkeypatch):
    """The embedded engine reports its first token's log-prob of every sample 0.5 too high: a mismatch the trainer's
    recomputation must show as train_rollout_logprob_abs_diff_max ~ 0.5."""
    from polyrl.rollout.embedded import EmbeddedEngine
    generate = EmbeddedEngine.generate

    def skewed(self, prompts, params, *a, **kw):
        out = generate(self, prompts, params, *a, **kw)
        for s in out:
            s.rollout_logprobs = [s.rollout_logprobs[0] + 0.5, *s.rollout_logprobs[1:]]
        return out
    monkeypatch.setattr(EmbeddedEngine, "generate", skewed)


def test_gate_stops_the_run_at_the_first_step_past_the_threshold(tiny_model, arith_data, tmp_path, capsys,
                                                                  skewed_rollout_logprobs):
    run = tmp_path / "run"
    assert main(_base(tiny_model, arith_data["train"], run, "--rm-type", "arithmetic", "--num-rollout", "3",
                      "--ci-train-rollout-logprob-abs-diff-threshold", "0.01")) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    # the skew sits on every sample's first response token (which sample is largest is rounding): token 0 is named
    import re
    m = re.match(r"polyrl train: error: step 1, sample \d+ of the step's batch, response token 0: "
                 r"train_rollout_logprob_abs_diff_max ", last)
    assert m and "--ci-train-rollout-logprob-abs-diff-threshold 0.01" in last, last
    head = m.group(0)
    (row,) = _rows(run)
    # the engine and the trainer agree to < 1e-4 on fp32 CPU (tests/test_loop.py), so the skew is the max within 1e-4
    assert row["train_rollout_logprob_abs_diff_max"] == pytest.approx(0.5, abs=1e-4)
    assert float(last[len(head):].split()[0]) == pytest.approx(row["train_rollout_logprob_abs_diff_max"], rel=1e-5)


def test_gate_with_a_loose_threshold_lets_the_run_finish(tiny_model, arith_data, tmp_path, skewed_rollout_logprobs):
    run = tmp_path / "run"
    assert main(_base(tiny_model, arith_data["train"], run, "--rm-type", "arithmetic", "--num-rollout", "2",
                      "--ci-train-rollout-logprob-abs-diff-threshold", "0.6")) == 0
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # one token per sample is off by 0.5: the max shows it, the mean is diluted over the step's tokens
        assert r["train_rollout_logprob_abs_diff_max"] == pytest.approx(0.5, abs=1e-4)
        assert r["train_rollout_logprob_abs_diff"] < r["train_rollout_logprob_abs_diff_max"]


def test_unskewed_run_passes_a_tight_gate(tiny_model, arith_data, tmp_path):
    # 1e-4: tests/test_loop.py's bound on the mean, here on every token (fp32 CPU kernels differ by ~1e-7 per token)
    run = tmp_path / "run"
    assert main(_base(tiny_model, arith_data["train"], run, "--rm-type", "arithmetic", "--num-rollout", "2",
                      "--ci-train-rollout-logprob-abs-diff-threshold", "1e-4")) == 0
    assert all(0 <= r["train_rollout_logprob_abs_diff"] <= r["train_rollout_logprob_abs_diff_max"] <= 1e-4 for r in _rows(run))


# ---- used run directories ----

def test_a_used_run_dir_is_refused_unless_overwrite_and_a_resume_logs_each_step_once(tiny_model, arith_data, tmp_path, capsys):
    run, ck = tmp_path / "run", tmp_path / "ck"
    args = _base(tiny_model, arith_data["train"], run, "--rm-type", "arithmetic")
    assert main([*args, "--num-rollout", "3", "--save", str(ck), "--save-interval", "1"]) == 0
    first = _rows(run)
    assert main([*args, "--num-rollout", "1"]) == 2
    err = capsys.readouterr().err
    assert f"--run-dir {run} holds an earlier run" in err and "--overwrite" in err and "--load" in err
    assert _rows(run) == first  # untouched
    # resume from step 2 into the same run dir: step 3 is logged again, once
    assert main([*args, "--num-rollout", "3", "--load", str(ck / "step_000002")]) == 0
    assert [r["step"] for r in _rows(run)] == [1, 2, 3] and _rows(run)[:2] == first[:2]
    assert main([*args, "--num-rollout", "1", "--overwrite"]) == 0
    assert [r["step"] for r in _rows(run)] == [1]


# ---- Ctrl-C and SIGTERM: one line, the state left behind, 130 / 143 ----

def _start(tiny_model, arith_data, tmp_path, *extra) -> subprocess.Popen:
    """A 500-step run (far longer than the test waits), its output in files: a full pipe nobody reads would block it."""
    cmd = [sys.executable, "-m", "polyrl", *_base(tiny_model, arith_data["train"], tmp_path / "run", "--rm-type", "arithmetic",
                                                  "--num-rollout", "500", *extra)]
    proc = subprocess.Popen(cmd, stdout=open(tmp_path / "out.txt", "w"), stderr=open(tmp_path / "err.txt", "w"))
    proc.err_path = tmp_path / "err.txt"
    return proc


def _wait_for(path, proc: subprocess.Popen, what: str, seconds: float = 180.0) -> None:
    deadline = time.monotonic() + seconds
    while not (os.path.isfile(path) and os.path.getsize(path) > 0):
        if proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}: {open(proc.err_path).read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {what} ({path}) within {seconds} s")
        time.sleep(0.1)


def _signal_and_wait(proc: subprocess.Popen, sig: int) -> str:
    proc.send_signal(sig)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the run did not exit within 120 s of the signal")
    return open(proc.err_path).read()


def test_ctrl_c_ends_with_one_line_naming_the_latest_complete_checkpoint(tiny_model, arith_data, tmp_path):
    ck = tmp_path / "ck"
    proc = _start(tiny_model, arith_data, tmp_path, "--save", str(ck), "--save-interval", "1")
    _wait_for(ck / "latest", proc, "first complete checkpoint")
    err = _signal_and_wait(proc, signal.SIGINT)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    (line,) = [l for l in err.splitlines() if "interrupted" in l]
    assert line.startswith("polyrl train: interrupted by Ctrl-C (SIGINT)")
    named = line.split("latest complete checkpoint: ")[1].split(" ")[0]
    assert os.path.isfile(os.path.join(named, "COMPLETE")) and f"--load {ck}" in line


def test_sigterm_ends_with_one_line_saying_nothing_was_saved(tiny_model, arith_data, tmp_path):
    proc = _start(tiny_model, arith_data, tmp_path)
    _wait_for(tmp_path / "run" / "metrics.jsonl", proc, "first step's metrics line")
    err = _signal_and_wait(proc, signal.SIGTERM)
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err
    (line,) = [l for l in err.splitlines() if "interrupted" in l]
    assert line.startswith("polyrl train: interrupted by SIGTERM") and "nothing was saved (no --save)" in line


def test_a_signal_inside_the_gc_pause_callback_is_deferred_not_printed_and_dropped(monkeypatch):
    """Python calls garbage-collector callbacks where an exception is printed ("Exception ignored in ...") and
    dropped: a signal arriving inside GcWatch's callback only sets the flag (the loop stops at the end of the step),
    anywhere else it raises KeyboardInterrupt where the main thread is."""
    import types

    from polyrl import cli
    from polyrl.metrics import PROGRESS, GcWatch
    monkeypatch.setitem(PROGRESS, "signal", None)
    inside = types.SimpleNamespace(f_code=GcWatch._on_gc.__code__)
    assert cli._on_signal(signal.SIGINT, inside) is None and PROGRESS["signal"] == "SIGINT"
    PROGRESS["signal"] = None
    with pytest.raises(KeyboardInterrupt):
        cli._on_signal(signal.SIGTERM, sys._getframe())
    assert PROGRESS["signal"] == "SIGTERM"


def test_a_sigint_whose_keyboardinterrupt_is_swallowed_still_stops_the_run_after_its_step(tiny_model, arith_data, tmp_path,
                                                                                         capsys, monkeypatch):
    """A signal's KeyboardInterrupt is raised wherever the main thread is; code that catches everything there (a
    library's catch-all, a finalizer, where Python prints and drops it) loses it. The run must still stop at the end
    of that step with the one line and 130: here the signal arrives inside such a catch-all during step 2."""
    from polyrl.step import book as book_mod
    calls = []
    stats = book_mod.Book.engine_stats

    def swallowing(self):
        calls.append(1)
        if len(calls) == 2:
            try:
                os.kill(os.getpid(), signal.SIGINT)  # the handler runs at the next bytecode, inside this try
                time.sleep(0.05)
            except KeyboardInterrupt:
                pass
        return stats(self)
    monkeypatch.setattr(book_mod.Book, "engine_stats", swallowing)
    run = tmp_path / "run"
    assert main([*_base(tiny_model, arith_data["train"], run, "--rm-type", "arithmetic", "--num-rollout", "5")]) == 130
    assert [r["step"] for r in _rows(run)] == [1, 2]  # step 2 finished (logged), step 3 never started
    err = capsys.readouterr().err
    (line,) = [l for l in err.splitlines() if "interrupted" in l]
    assert line.startswith("polyrl train: interrupted by Ctrl-C (SIGINT)") and "Traceback" not in err
    from polyrl.metrics import PROGRESS
    assert PROGRESS["signal"] is None  # reset for the next run in this process


def test_a_signal_ends_the_command_without_finalizing_the_work_it_cut_off(tiny_model, arith_data, tmp_path):
    """The `polyrl` command ended by SIGINT mid-work: the one line and 130, and nothing the interrupted frames hold is
    finalized. (A torch.save cut off mid-write leaves a C++ zip writer whose destructor writes to the file DCP has
    closed by then: a std::terminate, exit -6, seen once in `make test`.) The work here is a stand-in for the train
    loop that records whether it was finalized."""
    mark = tmp_path / "finalized"
    argv = _base(tiny_model, arith_data["train"], tmp_path / "run", "--rm-type", "arithmetic")
    code = f"""
import os, signal, sys, time
import polyrl.loop

class CutOff:
    def __del__(self):
        open({str(mark)!r}, "w").write("finalized")

def train(cfg):
    work = CutOff()
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(60)

polyrl.loop.train = train
from polyrl.cli import cli
sys.argv = ["polyrl", *{argv!r}]
sys.exit(cli())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 130, out.stderr[-3000:]
    (line,) = [l for l in out.stderr.splitlines() if "interrupted" in l]
    assert line.startswith("polyrl train: interrupted by Ctrl-C (SIGINT)") and "Traceback" not in out.stderr
    assert not mark.exists()  # never torn down: the process ended at once


def test_a_finished_command_runs_its_atexit_handlers_and_ends_without_finalizing(tiny_model, arith_data, tmp_path):
    """The `polyrl` command after a normal end: exit 0, the atexit handlers ran (logging's, multiprocessing's, weakref
    finalizers'), and the interpreter was not finalized: a gloo worker thread that drops a finished collective's tensors
    late needs the GIL, and a finalizing interpreter ends that thread, aborting a run that had finished (exit -6,
    "terminate called without an active exception", seen in `make test` in 2-rank CPU runs; core dump: the thread was in
    ProcessGroupGloo::runLoop destroying an AsyncAllgatherWork). The train loop here is a stand-in that leaves an object
    only finalization would tear down."""
    left, handler = tmp_path / "finalized", tmp_path / "atexit_ran"
    argv = _base(tiny_model, arith_data["train"], tmp_path / "run", "--rm-type", "arithmetic")
    code = f"""
import atexit, sys
import polyrl.loop

class Left:
    def __del__(self, _open=open):  # open bound now: finalization may have cleared the builtins by then
        _open({str(left)!r}, "w").write("finalized")

kept = []

def train(cfg):
    atexit.register(lambda: open({str(handler)!r}, "w").write("ran"))
    kept.append(Left())
    return {{}}

polyrl.loop.train = train
from polyrl.cli import cli
sys.argv = ["polyrl", *{argv!r}]
sys.exit(cli())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert handler.read_text() == "ran"
    assert not left.exists()


# ---- a port in use: one line naming it, before the model loads ----

def test_serve_on_a_port_in_use_names_port_and_flag_before_loading(tiny_model, capsys, monkeypatch):
    from polyrl.rollout import embedded

    def never(*a, **kw):
        raise AssertionError("the model was loaded although the port is taken")
    monkeypatch.setattr(embedded, "engine_from_config", never)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "--hf-checkpoint", tiny_model, "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"port {port} on 127.0.0.1 is already in use" in err and "--port" in err and "Traceback" not in err


# ---- torn or tampered checkpoints: errors naming the file ----

def test_truncated_or_missing_checkpoint_files_are_named(tiny_model, arith_data, tmp_path, capsys):
    ck = tmp_path / "ck"
    assert main(_base(tiny_model, arith_data["train"], tmp_path / "first", "--rm-type", "arithmetic", "--num-rollout", "1",
                      "--save", str(ck))) == 0
    args = _base(tiny_model, arith_data["train"], tmp_path / "run", "--rm-type", "arithmetic", "--num-rollout", "2")
    for name, damage in (("dcp/__0_0.distcp", "truncate"), ("extra_rank0.pt", "truncate"), ("dcp/__0_0.distcp", "remove"),
                         ("loop_state.json", "truncate")):
        bad = tmp_path / f"bad_{name.replace('/', '_')}_{damage}"
        shutil.copytree(ck, bad)
        f = bad / "step_000001" / name
        if damage == "remove":
            os.remove(f)
        else:
            with open(f, "r+b") as fh:
                fh.truncate(os.path.getsize(f) // 2)
        assert main([*args, "--load", str(bad)]) == 2, name
        err = capsys.readouterr().err
        assert str(f) in err and ("missing" if damage == "remove" else "truncated") in err, err
        assert "Traceback" not in err


# ---- secrets never reach what a run writes ----

def test_the_api_key_is_in_no_file_of_the_run_dir_or_the_checkpoint(tiny_model, arith_data, tmp_path):
    secret = "sk-polyrl-test-4f1d9c"
    run, ck = tmp_path / "run", tmp_path / "ck"
    assert main(_base(tiny_model, arith_data["train"], run, "--rm-type", "arithmetic", "--num-rollout", "1",
                      "--save", str(ck), "--rollout-engine", "server", "--api-key", secret)) == 0
    files = [os.path.join(d, f) for root in (run, ck) for d, _, fs in os.walk(root) for f in fs]
    assert any(f.endswith("loop_state.json") for f in files) and any(f.endswith("metrics.jsonl") for f in files)
    for f in files:
        assert secret.encode() not in open(f, "rb").read(), f
    state = json.load(open(ck / "step_000001" / "loop_state.json"))
    assert state["config"]["engines"]["api_key"] == "<redacted>"
    assert state["config"]["data"]["input_key"] == "prompt"  # a row field's name is no secret


def test_the_wandb_run_config_has_no_secret(monkeypatch, tmp_path):
    import types

    from polyrl.config import Config
    from polyrl.metrics import logger_from_config
    seen = {}
    fake = types.SimpleNamespace(init=lambda **kw: seen.update(kw) or types.SimpleNamespace(finish=lambda: None))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = Config()
    cfg.log.run_dir, cfg.log.use_wandb, cfg.log.quiet = str(tmp_path), True, True
    cfg.engines.api_key = cfg.server.api_key = "sk-secret"
    logger_from_config(cfg, total_steps=1, enabled=True, title="t").close()
    assert seen["config"]["engines"]["api_key"] == seen["config"]["server"]["api_key"] == "<redacted>"
    assert "sk-secret" not in json.dumps(seen["config"])


# ---- CUDA out of memory: one line with where, what was asked, how memory was held and what shrinks it ----

def test_cuda_out_of_memory_is_one_line_naming_the_flags_that_shrink_memory(tiny_model, arith_data, tmp_path, capsys,
                                                                             monkeypatch):
    import torch
    import polyrl.loop

    def oom(cfg):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 180.00 MiB. GPU 0 has a total capacity of "
                                     "79.18 GiB of which 4.56 MiB is free.")
    monkeypatch.setattr(polyrl.loop, "train", oom)
    assert main(_base(tiny_model, arith_data["train"], tmp_path / "run", "--rm-type", "arithmetic")) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [l for l in err.splitlines() if "out of memory" in l]
    assert line.startswith("polyrl train: error: CUDA out of memory while starting up")
    assert "(Tried to allocate 180.00 MiB)" in line
    assert all(f in line for f in ("--max-tokens-per-gpu", "--micro-batch-size", "--gradient-checkpointing",
                                   "--offload-train", "--rollout-mem-fraction"))


def test_memory_held_sets_cuda_graph_pools_apart():
    from polyrl.cli import memory_held
    segments = [{"total_size": 40 << 30, "allocated_size": 30 << 30, "segment_pool_id": (0, 0)},
                {"total_size": 6 << 30, "allocated_size": 1 << 30, "segment_pool_id": (1, 4)},
                {"total_size": 2 << 20, "allocated_size": 0, "segment_pool_id": (0, 0)},
                {"total_size": 4 << 30, "allocated_size": 0, "segment_pool_id": [2, 0]}]  # a list, as JSON gives it
    assert memory_held(segments) == {"reserved": (50 << 30) + (2 << 20), "allocated": 31 << 30,
                                     "pool_reserved": 10 << 30, "pool_allocated": 1 << 30}
