"""What a run does when its disk fills, when a second run shares its --save directory, and when a resume would land on
other data, another run's directory or another model: one line each and the exit code, nothing lost."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from polyrl.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs `polyrl ARGS...` with one writer failing as a full disk does (errno 28), named by FULL_AT:
#   dcp:SUBSTR     DCP's shard streams of paths containing SUBSTR fail on their first write
#   metrics        appending to RUN_DIR/metrics.jsonl fails
#   safetensors    transformers' shard writer fails with safetensors' error (which carries no errno)
#   lock           writing the owner into SAVE/polyrl.lock fails
#   torn           torch.save of a file (a backend's extra_rank*.pt) fails as its zip writer does, without an errno
INJECT = r'''
import contextlib, errno, io, os, sys
where = os.environ["FULL_AT"]
full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
if where.startswith("dcp:"):
    from torch.distributed.checkpoint import filesystem as fs
    orig = fs.FileSystem.create_stream
    class Full(io.FileIO):
        def write(self, b):
            raise full
    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" in mode and where[4:] in str(path):
            with Full(str(path), "w") as f:
                yield f
        else:
            with orig(self, path, mode) as f:
                yield f
    fs.FileSystem.create_stream = create_stream
elif where == "metrics":
    import builtins, polyrl.metrics
    class FullFile(io.TextIOWrapper):
        def write(self, s):
            raise full
    def fake_open(path, mode="r", *a, **k):
        if str(path).endswith("metrics.jsonl") and "a" in mode:
            return FullFile(builtins.open(path, mode + "b" if "b" not in mode else mode))
        return builtins.open(path, mode, *a, **k)
    polyrl.metrics.open = fake_open
elif where == "lock":
    import polyrl.checkpoint
    def pwrite(*a):
        raise full
    polyrl.checkpoint.os.pwrite = pwrite
elif where == "torn":
    import torch
    orig_save = torch.save
    def save(obj, f, *a, **k):
        if isinstance(f, str) and f.endswith(".pt"):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return orig_save(obj, f, *a, **k)
    torch.save = save
elif where == "safetensors":
    import safetensors, transformers.modeling_utils as mu
    def save_file(*a, **k):
        raise safetensors.SafetensorError('Error while serializing: I/O error: No space left on device (os error 28)')
    mu.safe_save_file = save_file
sys.argv = ["polyrl", *sys.argv[1:]]
from polyrl.cli import cli
cli()
'''


def _run(tmp_path, full_at: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    script = tmp_path / "inject.py"
    script.write_text(INJECT)
    env = dict(os.environ, FULL_AT=full_at, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(script), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _train_args(tiny_model, data, run, *extra):
    return ["train", "--hf-checkpoint", tiny_model, "--prompt-data", data, "--rm-type", "arithmetic", "--quiet",
            "--device", "cpu", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len",
            "4", "--run-dir", str(run), *extra]


def _last_line(p: subprocess.CompletedProcess) -> str:
    return p.stderr.strip().splitlines()[-1]


# ---- a full disk ----

def test_disk_full_during_save_is_one_line_naming_the_latest_complete_checkpoint(tiny_model, arith_data, tmp_path):
    ck = tmp_path / "ck"
    p = _run(tmp_path, "dcp:step_000002", *_train_args(tiny_model, arith_data["train"], tmp_path / "run", "--save", str(ck),
                                                        "--save-interval", "1", "--num-rollout", "3"))
    assert p.returncode == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    line = _last_line(p)
    assert line.startswith(f"polyrl train: error: No space left on device writing {ck / 'step_000002.tmp'} during the "
                           "checkpoint save of step 2"), line
    assert f"latest complete checkpoint: {ck / 'step_000001'} (resume with --load {ck})" in line
    assert open(ck / "latest").read() == "step_000001" and not (ck / "step_000002").exists()
    assert not (ck / "polyrl.lock").exists()  # the failed run let go of the directory


def test_disk_full_when_taking_the_save_dir_is_one_line(tiny_model, arith_data, tmp_path):
    ck = tmp_path / "ck"
    p = _run(tmp_path, "lock", *_train_args(tiny_model, arith_data["train"], tmp_path / "run", "--save", str(ck)))
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert _last_line(p) == (f"polyrl train: error: No space left on device writing {ck / 'polyrl.lock'} while starting "
                             f"up, before the first step; no complete checkpoint in --save {ck} yet")


def test_a_torn_torch_save_with_space_left_is_a_failed_write_in_one_line(tiny_model, arith_data, tmp_path):
    ck = tmp_path / "ck"
    p = _run(tmp_path, "torn", *_train_args(tiny_model, arith_data["train"], tmp_path / "run", "--save", str(ck),
                                           "--num-rollout", "1"))
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert _last_line(p) == (f"polyrl train: error: Write failed ([enforce fail at inline_container.cc:672] . unexpected "
                             f"pos 704 vs 598) writing {ck / 'step_000001.tmp'} during the checkpoint save of step 1 (left "
                             f"incomplete; the next save clears it); no complete checkpoint in --save {ck} yet")


def test_disk_full_in_the_run_dir_is_one_line(tiny_model, arith_data, tmp_path):
    run = tmp_path / "run"
    p = _run(tmp_path, "metrics", *_train_args(tiny_model, arith_data["train"], run, "--num-rollout", "2"))
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert _last_line(p) == (f"polyrl train: error: No space left on device writing {run / 'metrics.jsonl'} after step 1; "
                             "nothing was saved (no --save)")


def test_disk_full_during_save_hf_keeps_the_earlier_export_and_says_the_weights_are_lost(tiny_model, arith_data, tmp_path):
    out = tmp_path / "exported"
    shutil.copytree(tiny_model, out)  # the earlier export
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    p = _run(tmp_path, "safetensors", *_train_args(tiny_model, arith_data["train"], tmp_path / "run", "--num-rollout", "1",
                                                    "--save-hf", str(out)))
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert _last_line(p) == (f"polyrl train: error: No space left on device writing {out} after step 1; the earlier export "
                             f"in {out} is kept as it was; the trained weights are lost (no --save): free space and run "
                             "again, with --save DIR to keep a checkpoint")
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before
    assert not os.path.exists(str(out) + ".tmp")  # what the failed export wrote is gone, its space given back


# ---- one --save directory, one run ----

def test_a_second_run_on_a_save_dir_is_refused_until_the_first_one_is_gone(tiny_model, arith_data, tmp_path, capsys):
    ck = tmp_path / "ck"
    first = subprocess.Popen([sys.executable, "-m", "polyrl", *_train_args(
        tiny_model, arith_data["train"], tmp_path / "run1", "--save", str(ck), "--save-interval", "1", "--num-rollout", "500")],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while f'"pid": {first.pid}' not in ((ck / "polyrl.lock").read_text() if (ck / "polyrl.lock").exists() else ""):
            assert first.poll() is None, "the first run ended before it owned its save directory"
            assert time.monotonic() < deadline, "the first run did not take its --save directory within 120 s"
            time.sleep(0.2)
        second = _train_args(tiny_model, arith_data["train"], tmp_path / "run2", "--save", str(ck), "--num-rollout", "1")
        assert main(second) == 2
        err = capsys.readouterr().err
        assert f"--save {ck} is in use by another run (polyrl train pid {first.pid} on host" in err, err
        assert not (tmp_path / "run2").exists()
    finally:
        first.send_signal(signal.SIGKILL)  # dies holding the lock, as a killed or crashed run does
        first.wait(timeout=60)
    assert main(second) == 0
    err = capsys.readouterr().err
    assert f"taking over from polyrl train pid {first.pid}" in err
    assert os.path.isfile(ck / "step_000001" / "COMPLETE")


# ---- resumes that would land elsewhere ----

@pytest.fixture
def saved(tiny_model, arith_data, tmp_path):
    """A 2-step run on a 16-row copy of the prompts, saved after each step: (prompt file, save dir, run dir)."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(open(arith_data["train"]).readlines()[:16]))
    ck, run = tmp_path / "ck", tmp_path / "run"
    assert main(_train_args(tiny_model, str(data), run, "--save", str(ck), "--save-interval", "1", "--num-rollout", "2",
                            "--rollout-batch-size", "4")) == 0
    return data, ck, run


def test_resuming_on_a_shrunk_prompt_file_is_refused_naming_what_changed(saved, tiny_model, capsys):
    data, ck, run = saved
    data.write_text("".join(data.read_text().splitlines(keepends=True)[:5]))  # position 8 is past its end now
    args = _train_args(tiny_model, str(data), run, "--load", str(ck), "--num-rollout", "3", "--rollout-batch-size", "4")
    rows = len(open(run / "metrics.jsonl").readlines())
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "polyrl train: error: --load: the data changed since the checkpoint was saved" in err
    assert "rows 16 -> 5" in err and "(epoch 0, prompt 8)" in err and "--allow-data-change" in err
    assert "Traceback" not in err and len(open(run / "metrics.jsonl").readlines()) == rows
    assert main(args + ["--allow-data-change"]) == 0
    err = capsys.readouterr().err
    assert "WARNING --allow-data-change: the data changed" in err and "resuming at step 3" in err


def test_resuming_into_another_runs_dir_is_refused_naming_both(saved, tiny_model, tmp_path, capsys):
    data, ck, run = saved
    other = tmp_path / "other"
    os.makedirs(other)
    (other / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)))
    before = (other / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(_train_args(tiny_model, str(data), other, "--load", str(ck), "--num-rollout", "3",
                            "--rollout-batch-size", "4")) == 2
    err = capsys.readouterr().err
    assert f"--load {ck} was saved by the run logging to --run-dir {run}, and --run-dir {other} holds another run's" in err
    assert (other / "metrics.jsonl").read_text() == before  # its step-3 row is still there
    assert main(_train_args(tiny_model, str(data), run, "--load", str(ck), "--num-rollout", "3",
                            "--rollout-batch-size", "4")) == 0  # its own run dir
    assert [json.loads(l)["step"] for l in open(run / "metrics.jsonl")] == [1, 2, 3]


def test_load_alone_evaluates_and_exports_with_the_base_model_the_checkpoint_records(saved, tiny_model, arith_data,
                                                                                      tmp_path, capsys):
    _, ck, _ = saved
    capsys.readouterr()
    assert main(["eval", "--load", str(ck), "--eval-prompt-data", arith_data["eval"] + "@[:4]", "--rm-type",
                 "arithmetic", "--rollout-max-response-len", "4", "--device", "cpu", "--run-dir", str(tmp_path / "ev")]) == 0
    assert f"--hf-checkpoint {os.path.abspath(tiny_model)}: the base model that --load {ck} was trained from" in \
        capsys.readouterr().err
    assert "eval/accuracy" in json.load(open(tmp_path / "ev" / "eval.json"))
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY")}
    p = subprocess.run([sys.executable, "-m", "polyrl", "export-hf", "--load", str(ck), "--save-hf", str(out), "--device",
                        "cpu"], cwd=ROOT, env=dict(env, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert _last_line(p) == f"polyrl: wrote {out}"
    assert os.path.isfile(out / "config.json")
    for bar in ("Loading weights", "Writing model shards"):  # transformers' bars stay out of polyrl's output
        assert bar not in p.stderr + p.stdout


def test_load_against_a_base_model_with_another_vocabulary_exits_2_with_one_line(saved, tiny_model, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    _, ck, _ = saved
    other = tmp_path / "wider"
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    model.resize_token_embeddings(model.config.vocab_size + 32)
    model.save_pretrained(other)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(other)
    capsys.readouterr()
    assert main(["export-hf", "--load", str(ck), "--hf-checkpoint", str(other), "--save-hf", str(tmp_path / "out"),
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len([l for l in err.splitlines() if "error" in l]) == 1, err
    assert "its tensors do not fit the model built from --hf-checkpoint" in err
    assert f"it was trained from {os.path.abspath(tiny_model)}" in err
    assert not (tmp_path / "out").exists()


# ---- the console in a log file ----

def test_step_lines_in_a_log_file_are_one_line_each_with_whole_labels(tmp_path, capsys):
    from polyrl.metrics import TIME_KEYS, MetricsLogger
    lg = MetricsLogger(str(tmp_path), total_steps=2, title="polyrl train")
    lg.log(1, {"reward/mean": 0.5, "reward/accuracy": 0.25, "response_len/mean": 7.0, "kl": 1e-3, "clip_frac": 0.0,
               "entropy": 1.2, "grad_norm": 3.0, "train_rollout_logprob_abs_diff": 1e-3, "tokens_per_s": 1234,
               **{f"time/{k}": 1.0 for k in TIME_KEYS}})
    lg.close()
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step 1")]
    assert len(line) > 80 and "rollout 1.0s" in line and "sync 1.0s" in line and "step 1.0s" in line
    assert "rollou " not in line


def test_sft_prints_progress_lines_without_the_live_view(tiny_model, tmp_path, capsys):
    from polyrl.sft import _progress_step
    assert sum(_progress_step(s, 0, 600) for s in range(1, 601)) == 10  # a tenth of a long run each
    assert [_progress_step(s, 2, 5) for s in (3, 4, 5)] == [True, True, True]  # every step of a short one
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "response": str(i + 1)}) + "\n" for i in range(8)))
    assert main(["sft", "--hf-checkpoint", tiny_model, "--prompt-data", str(data), "--global-batch-size", "4",
                 "--num-epoch", "2", "--device", "cpu", "--quiet", "--run-dir", str(tmp_path / "run")]) == 0
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("polyrl: sft step")]
    assert [ln.split(" (")[0] for ln in lines] == [f"polyrl: sft step {s}/4" for s in (1, 2, 3, 4)]
    assert "loss" in lines[-1]
