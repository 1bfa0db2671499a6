"""What a long run needs from the outside: eval progress and its samples on disk, a timing of the checkpoint write of
its own, a stop at a step boundary with a checkpoint (SIGUSR1, --max-wall-time), a resume at another --lr, checkpoints
without the optimizer state (--no-save-optim), checkpoints written in the background (--async-save), and the SFT
console line with its loss."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from polyrl.cli import main


def rows(run) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]


def train_args(model: str, data: str, run, *extra: str) -> list[str]:
    return ["train", "--hf-checkpoint", model, "--prompt-data", data, "--rm-type", "arithmetic", "--rollout-batch-size",
            "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "3", "--num-rollout", "3", "--lr", "1e-3",
            "--device", "cpu", "--quiet", "--seed", "1", "--run-dir", str(run), *extra]


def test_eval_prints_progress_and_writes_every_sample(tiny_model, arith_data, tmp_path, capsys, monkeypatch):
    import polyrl.cli as cli
    monkeypatch.setattr(cli, "EVAL_PROGRESS_S", 0.01)
    assert main(["eval", "--hf-checkpoint", tiny_model, "--eval-prompt-data", arith_data["eval"] + "@[:6]", "--rm-type",
                 "arithmetic", "--device", "cpu", "--rollout-max-response-len", "4", "--run-dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "eval: generating 6 prompts ..." in err and "eval: generating 6 prompts: 6 samples in" in err
    samples = [json.loads(line) for line in open(tmp_path / "eval_samples.jsonl")]
    labels = [json.loads(line)["label"] for line in open(arith_data["eval"])][:6]
    assert [s["label"] for s in samples] == labels
    assert all(set(s) >= {"prompt", "response", "label", "reward"} and s["reward"] in (0.0, 1.0) for s in samples)
    accuracy = json.load(open(tmp_path / "eval.json"))["eval/accuracy"]
    assert accuracy == sum(s["reward"] for s in samples) / 6 and f"accuracy {accuracy:.3f}" in err


def test_train_writes_each_evals_samples_and_times_its_saves(tiny_model, arith_data, tmp_path):
    run = tmp_path / "run"
    assert main(train_args(tiny_model, arith_data["train"], run, "--eval-prompt-data", arith_data["eval"] + "@[:4]",
                           "--eval-interval", "2", "--save", str(tmp_path / "ck"), "--save-interval", "2")) == 0
    assert sorted(os.listdir(run / "eval_samples")) == ["step_0.jsonl", "step_2.jsonl", "step_3.jsonl"]
    assert len(open(run / "eval_samples" / "step_3.jsonl").readlines()) == 4
    saved = [r["step"] for r in rows(run) if "time/save" in r]
    assert saved == [2, 3] and all(r["time/save"] > 0 for r in rows(run) if "time/save" in r)
    for r in rows(run)[1:]:  # the save is a phase of its own: the step's time is the phases and a small rest
        assert abs(r["time/step"] - sum(v for k, v in r.items() if k.startswith("time/") and k not in (
            "time/step", "time/gc"))) < 1e-6


def test_sigusr1_stops_after_the_step_in_flight_with_its_checkpoint_and_the_run_resumes(
        tiny_model, arith_data, tmp_path, capsys, monkeypatch):
    from polyrl.step.learner import Learner
    update = Learner.update

    def signalled_in_step_2(self, samples, scored, step, m, timer):
        if step == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        return update(self, samples, scored, step, m, timer)
    monkeypatch.setattr(Learner, "update", signalled_in_step_2)
    ck, run = tmp_path / "ck", tmp_path / "run"
    assert main(train_args(tiny_model, arith_data["train"], run, "--save", str(ck), "--num-rollout", "5")) == 0
    err = capsys.readouterr().err
    assert f"stopped after step 2 of 5 on SIGUSR1: checkpoint of step 2 in --save {ck}" in err
    assert [r["step"] for r in rows(run)] == [1, 2] and "time/save" in rows(run)[-1]
    monkeypatch.setattr(Learner, "update", update)
    assert main(train_args(tiny_model, arith_data["train"], run, "--save", str(ck), "--num-rollout", "3",
                           "--load", str(ck))) == 0
    assert [r["step"] for r in rows(run)] == [1, 2, 3]


def test_max_wall_time_stops_before_a_step_that_would_end_past_it(tiny_model, arith_data, tmp_path, capsys):
    ck, run = tmp_path / "ck", tmp_path / "run"
    assert main(train_args(tiny_model, arith_data["train"], run, "--save", str(ck), "--max-wall-time", "0.001")) == 0
    assert "stopped after step 1 of 3 on --max-wall-time 0.001 s" in capsys.readouterr().err
    assert [r["step"] for r in rows(run)] == [1] and os.listdir(ck)


def test_max_wall_time_without_save_is_refused(tiny_model, arith_data, tmp_path, capsys):
    assert main(train_args(tiny_model, arith_data["train"], tmp_path / "run", "--max-wall-time", "60")) == 2
    assert "--max-wall-time 60 stops the run with a checkpoint to resume from: add --save DIR" in capsys.readouterr().err


def test_a_resume_at_another_lr_applies_it_and_says_so(tiny_model, arith_data, tmp_path, capsys):
    ck, run = tmp_path / "ck", tmp_path / "run"
    assert main(train_args(tiny_model, arith_data["train"], run, "--save", str(ck), "--num-rollout", "1")) == 0
    assert main(train_args(tiny_model, arith_data["train"], run, "--save", str(ck), "--num-rollout", "2", "--lr", "3e-4",
                           "--load", str(ck))) == 0
    assert "--lr 0.0003 applies from the resumed step on (the checkpoint was trained at 0.001)" in capsys.readouterr().err
    assert [r["lr"] for r in rows(run)] == [pytest.approx(1e-3), pytest.approx(3e-4)]  # a constant schedule


def test_no_save_optim_leaves_the_optimizer_out_and_a_resume_starts_it_from_zero(tiny_model, arith_data, tmp_path,
                                                                                  capsys):
    """--no-save-optim: the checkpoint holds the weights but no optimizer entry (a third of the bytes for FP32 AdamW).
    Resumed from it and from a full checkpoint of the same step, step 2 samples and scores the same (the same weights:
    equal reward, loss and gradient norm, which come before the update) and then updates differently (fresh moments)."""
    from safetensors.torch import load_file

    from polyrl.checkpoint import has_optimizer_state

    def dcp_bytes(ck) -> int:
        d = ck / "step_000001" / "dcp"
        return sum(os.path.getsize(d / f) for f in os.listdir(d))
    rm = tmp_path / "rm.py"  # partial credit: the random model's samples differ in reward, so every step has a gradient
    rm.write_text("def digits(sample):\n    return sum(c.isdigit() for c in sample.response) / 3.0\n")

    def args(name: str, *extra: str) -> list[str]:
        a = train_args(tiny_model, arith_data["train"], tmp_path / f"run_{name}", "--n-samples-per-prompt", "4",
                       "--rollout-max-response-len", "6", *extra)
        i = a.index("--rm-type")
        return a[:i] + ["--custom-rm-path", f"{rm}:digits"] + a[i + 2:]
    for name, extra in (("full", ()), ("lean", ("--no-save-optim",))):
        assert main(args(name, "--save", str(tmp_path / name), "--num-rollout", "1", *extra)) == 0
    full, lean = tmp_path / "full", tmp_path / "lean"
    assert has_optimizer_state(str(full / "step_000001" / "dcp"))
    assert not has_optimizer_state(str(lean / "step_000001" / "dcp"))
    assert dcp_bytes(lean) < 0.4 * dcp_bytes(full)  # weights only, against weights + two moments
    capsys.readouterr()
    for name in ("full", "lean"):
        assert main(args(name, "--num-rollout", "2", "--load", str(tmp_path / name), "--save-hf",
                         str(tmp_path / f"hf_{name}"))) == 0
    assert capsys.readouterr().err.count("holds no optimizer state (saved with --no-save-optim)") == 1
    a, b = rows(tmp_path / "run_full")[-1], rows(tmp_path / "run_lean")[-1]
    assert a["step"] == b["step"] == 2 and a["grad_norm"] > 0
    for k in ("reward/mean", "loss", "grad_norm"):
        assert b[k] == pytest.approx(a[k], rel=1e-6, abs=1e-9), k
    wa, wb = (load_file(str(tmp_path / f"hf_{n}" / "model.safetensors")) for n in ("full", "lean"))
    assert any(not torch.equal(wa[k], wb[k]) for k in wa)


def dcp_model(step_dir) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = os.path.join(str(step_dir), "model.pt")
    dcp_to_torch_save(os.path.join(str(step_dir), "dcp"), out)
    return torch.load(out, weights_only=True)["model"]


def test_async_save_writes_what_the_foreground_save_does_and_seals_it_a_step_later(tiny_model, arith_data, tmp_path):
    """--async-save: each checkpoint holds the weights of its own step, bit for bit those of a foreground save (the
    copy is taken before training goes on), sealed at the next step's end (time/save_wait); the last is complete
    before the run ends."""
    for name, extra in (("fg", ()), ("bg", ("--async-save",))):
        assert main(train_args(tiny_model, arith_data["train"], tmp_path / f"run_{name}", "--save",
                               str(tmp_path / name), "--save-interval", "1", *extra)) == 0
    from polyrl.checkpoint import complete_steps, latest_complete
    for name in ("fg", "bg"):
        assert complete_steps(str(tmp_path / name)) == [1, 2, 3]
        assert latest_complete(str(tmp_path / name)).endswith("step_000003")
    for step in (1, 2, 3):
        a, b = (dcp_model(tmp_path / n / f"step_{step:06d}") for n in ("fg", "bg"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), step
    fg, bg = rows(tmp_path / "run_fg"), rows(tmp_path / "run_bg")
    assert [r["step"] for r in bg if "time/save_wait" in r] == [2, 3] and not any("time/save_wait" in r for r in fg)
    assert [(r["loss"], r["reward/mean"]) for r in fg] == [(r["loss"], r["reward/mean"]) for r in bg]


def test_a_background_save_holds_the_state_of_its_call_not_what_training_does_next(tiny_model, tmp_path):
    """The weights change in place right after save(background=True) returns, before its write is waited for: the
    checkpoint holds the weights as they were at the call (DCP copied them to host memory first)."""
    from polyrl.backends.fsdp.backend import FSDPBackend
    from polyrl.config import BatchConfig, ModelConfig, OptimizerConfig
    from polyrl.dist import init_distributed
    init_distributed("cpu")
    be = FSDPBackend(ModelConfig(hf_checkpoint=tiny_model), OptimizerConfig(lr=1e-3), BatchConfig(), device="cpu")
    before = {k: v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone()
              for k, v in be._state_dicts()[0].items()}
    written = be.save(str(tmp_path), background=True)
    with torch.no_grad():
        for p in be.model.parameters():
            p.add_(1.0)
    written.result(timeout=120)
    saved = dcp_model(tmp_path)
    assert saved.keys() == before.keys() and all(torch.equal(saved[k], before[k]) for k in before)


def test_a_run_that_dies_before_its_background_write_is_sealed_resumes_from_the_one_before(
        tiny_model, arith_data, tmp_path, monkeypatch):
    from polyrl.checkpoint import latest_complete
    from polyrl.step.learner import Learner
    update = Learner.update

    def fails_in_step_3(self, samples, scored, step, m, timer):
        if step == 2:
            raise RuntimeError("injected failure in step 3")
        return update(self, samples, scored, step, m, timer)
    monkeypatch.setattr(Learner, "update", fails_in_step_3)
    ck, run = tmp_path / "ck", tmp_path / "run"
    with pytest.raises(RuntimeError, match="injected failure in step 3"):
        main(train_args(tiny_model, arith_data["train"], run, "--save", str(ck), "--save-interval", "1", "--async-save"))
    # step 1 was sealed at step 2's end; step 2's write was never sealed: it is not a checkpoint
    assert latest_complete(str(ck)).endswith("step_000001") and os.path.isdir(ck / "step_000002.tmp")
    monkeypatch.setattr(Learner, "update", update)
    assert main(train_args(tiny_model, arith_data["train"], run, "--save", str(ck), "--load", str(ck),
                           "--async-save")) == 0
    assert [r["step"] for r in rows(run)] == [1, 2, 3] and latest_complete(str(ck)).endswith("step_000003")
    assert not os.path.exists(ck / "step_000002.tmp")


def test_async_save_without_save_and_on_megatron_is_refused(tiny_model, arith_data, tmp_path, capsys):
    import dataclasses

    from polyrl.capabilities import refuse_unhonoured
    from polyrl.config import Config, ConfigError
    assert main(train_args(tiny_model, arith_data["train"], tmp_path / "run", "--async-save")) == 2
    assert "--async-save writes --save's checkpoints in the background: add --save DIR" in capsys.readouterr().err
    cfg = Config()
    cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, train_backend="megatron"),
                              checkpoint=dataclasses.replace(cfg.checkpoint, async_save=True, save="x"))
    with pytest.raises(ConfigError, match=r"--async-save is not honoured by --train-backend megatron"):
        refuse_unhonoured(cfg, "train")


def test_no_save_optim_on_the_megatron_backend_is_refused():
    import dataclasses

    from polyrl.capabilities import refuse_unhonoured
    from polyrl.config import Config, ConfigError
    cfg = Config()
    cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, train_backend="megatron"),
                              checkpoint=dataclasses.replace(cfg.checkpoint, save_optim=False))
    with pytest.raises(ConfigError, match=r"--no-save-optim is not honoured by --train-backend megatron"):
        refuse_unhonoured(cfg, "train")


def test_the_sft_console_line_shows_the_loss(tiny_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # rich wraps the step line at the console width
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "response": str(i + 1)}) + "\n" for i in range(4)))
    assert main(["sft", "--hf-checkpoint", tiny_model, "--prompt-data", str(data), "--global-batch-size", "4",
                 "--device", "cpu", "--run-dir", str(tmp_path / "run")]) == 0
    [r] = rows(tmp_path / "run")
    assert f"loss {r['loss']:.4f}" in capsys.readouterr().out


def test_max_wall_time_with_ray_is_refused(tiny_model, arith_data, tmp_path, capsys):
    assert main(train_args(tiny_model, arith_data["train"], tmp_path / "run", "--save", str(tmp_path / "ck"),
                           "--max-wall-time", "60", "--use-ray", "--colocate")) == 2
    assert "--max-wall-time stops the loop of this process" in capsys.readouterr().err


def test_sft_stops_at_a_step_boundary_with_its_checkpoint_and_times_the_save(tiny_model, tmp_path, capsys):
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "response": str(i + 1)}) + "\n" for i in range(8)))
    ck, run = tmp_path / "ck", tmp_path / "run"
    assert main(["sft", "--hf-checkpoint", tiny_model, "--prompt-data", str(data), "--global-batch-size", "2",
                 "--device", "cpu", "--quiet", "--save", str(ck), "--max-wall-time", "0.001", "--run-dir", str(run)]) == 0
    assert f"stopped after step 1 of 4 on --max-wall-time 0.001 s (another step would end past it): checkpoint of step 1" \
           in capsys.readouterr().err
    [r] = rows(run)
    assert r["step"] == 1 and r["time/save"] > 0 and (ck / "step_000001").is_dir()
