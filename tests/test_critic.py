"""PPO with a learned critic (--advantage-estimator gae) through the CLI on CPU (FSDP backend): metrics, exact resume,
export (--save-hf and export-hf) read back by --critic-load, flags in --help, and start-up errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from polyrl.cli import main

REWARD = '''
def digits(sample):
    """partial credit so returns vary on an untrained model"""
    return sum(c.isdigit() for c in sample.response) / 8.0
'''
CRITIC = ["--advantage-estimator", "gae", "--gamma", "0.99", "--lambd", "0.95", "--critic-lr", "1e-3", "--value-clip", "0.2"]
KEYS = ("loss", "pg_loss", "grad_norm", "reward/mean", "critic/value_loss", "critic/vf_explained_var", "critic/vf_clipfrac",
        "critic/values_mean", "critic/grad_norm", "critic/lr")


@pytest.fixture
def args(tiny_model, arith_data, tmp_path):
    rm = tmp_path / "rm.py"
    rm.write_text(REWARD)
    return ["--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--custom-rm-path", f"{rm}:digits",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "6", "--lr", "1e-3",
            "--quiet", "--rollout-shuffle", "--seed", "3", "--device", "cpu", *CRITIC]


def train(args, run_dir, *extra) -> list[dict]:
    assert main(["train", *args, "--run-dir", str(run_dir), *extra]) == 0
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def test_ppo_with_critic_logs_critic_metrics_and_resumes_exactly(args, tmp_path):
    full = train(args, tmp_path / "full", "--num-rollout", "4")
    for r in full:
        assert set(KEYS) <= r.keys() and r["critic/skipped_step"] == 0 and r["critic/grad_norm"] > 0
    # a fresh head is zero: the first values are exactly 0, so explained variance is exactly 0; then the critic moves
    assert full[0]["critic/values_mean"] == 0.0 and full[0]["critic/vf_explained_var"] == pytest.approx(0.0, abs=1e-12)
    assert full[-1]["critic/values_mean"] != 0.0 and full[-1]["critic/lr"] == pytest.approx(1e-3)
    train(args, tmp_path / "first", "--num-rollout", "2", "--save", str(tmp_path / "ck"))
    assert os.path.isfile(tmp_path / "ck" / "step_000002" / "critic" / "dcp" / ".metadata")
    resumed = train(args, tmp_path / "second", "--num-rollout", "4", "--load", str(tmp_path / "ck"))
    assert [r["step"] for r in resumed] == [3, 4]
    # resume == uninterrupted: same fp32 CPU kernels on the same restored weights, Adam moments, schedule and RNG;
    # the tolerance of tests/test_loop.py's resume test (checkpoint round trips are bit-exact, sums may regroup)
    for a, b in zip(full[2:], resumed):
        for k in KEYS:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), k


def _critic_values(model_cfg, batch, load_dir=None):
    from polyrl.backends.fsdp.backend import FSDPBackend
    from polyrl.dist import init_distributed
    from polyrl.config import BatchConfig, OptimizerConfig
    init_distributed("cpu")
    critic = FSDPBackend(model_cfg, OptimizerConfig(lr=1e-3), BatchConfig(), device="cpu", role="critic")
    if load_dir is not None:
        critic.load(load_dir)
    return torch.cat(critic.compute_values(batch))


def test_exported_critic_equals_the_checkpoint_and_critic_load_reads_its_head(args, tiny_model, tmp_path):
    from polyrl.config import ModelConfig
    from polyrl.types import TrainBatch
    train(args, tmp_path / "run", "--num-rollout", "2", "--save", str(tmp_path / "ck"), "--save-hf", str(tmp_path / "hf"))
    assert main(["export-hf", "--hf-checkpoint", tiny_model, "--load", str(tmp_path / "ck"), "--save-hf",
                 str(tmp_path / "offline")]) == 0
    batch = TrainBatch([torch.tensor([1, 5, 7, 9, 11, 4]), torch.tensor([3, 8, 2, 6])], [2, 1])
    ckpt = _critic_values(ModelConfig(hf_checkpoint=tiny_model), batch, str(tmp_path / "ck" / "step_000002" / "critic"))
    online = _critic_values(ModelConfig(hf_checkpoint=tiny_model, critic_load=str(tmp_path / "hf_critic")), batch)
    offline = _critic_values(ModelConfig(hf_checkpoint=tiny_model, critic_load=str(tmp_path / "offline_critic")), batch)
    fresh = _critic_values(ModelConfig(hf_checkpoint=tiny_model), batch)
    assert ckpt.shape == (7,) and fresh.abs().max() == 0  # a fresh head is zero
    # the same fp32 weights in three containers (DCP, two safetensors exports) give bit-identical values on one CPU
    assert torch.equal(ckpt, online) and torch.equal(ckpt, offline) and ckpt.abs().max() > 0
    assert os.path.isfile(tmp_path / "hf" / "config.json")  # the actor is exported where it always was


def test_help_lists_the_critic_flags():
    out = subprocess.run([sys.executable, "-m", "polyrl", "train", "--help"], capture_output=True, text=True, timeout=120).stdout
    for flag in ("--lambd", "--value-clip", "--critic-lr", "--critic-num-warmup-steps", "--critic-load", "gae"):
        assert flag in out, flag


@pytest.mark.parametrize("extra, words", [
    (["--critic-lr", "0"], ["--critic-lr must be > 0"]),
    (["--lambd", "1.5"], ["--lambd must be in [0, 1]"]),
    (["--value-clip", "-0.1"], ["--value-clip must be >= 0", "0 turns value clipping off"]),
    (["--critic-num-warmup-steps", "-1"], ["--critic-num-warmup-steps must be >= 0"]),
])
def test_bad_critic_values_exit_2_naming_the_flag(args, tmp_path, capsys, extra, words):
    assert main(["train", *args, "--run-dir", str(tmp_path / "run"), "--num-rollout", "1", *extra]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_critic_flags_without_gae_and_a_checkpoint_without_critic_are_refused(args, tiny_model, tmp_path, capsys):
    no_gae = args[:-len(CRITIC)]
    assert main(["train", *no_gae, "--run-dir", str(tmp_path / "a"), "--lambd", "0.9", "--critic-lr", "1e-4"]) == 2
    err = capsys.readouterr().err
    assert "--critic-lr, --lambd" in err and "--advantage-estimator gae" in err
    assert main(["train", *args, "--run-dir", str(tmp_path / "b"), "--critic-load", str(tmp_path / "nowhere")]) == 2
    assert "--critic-load" in capsys.readouterr().err
    # a GRPO checkpoint has no critic: resuming it as PPO would silently start a fresh critic
    train(no_gae, tmp_path / "grpo", "--num-rollout", "1", "--save", str(tmp_path / "ck"))
    assert main(["train", *args, "--run-dir", str(tmp_path / "c"), "--num-rollout", "2", "--load", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert "no critic in this checkpoint" in err and "--advantage-estimator gae" in err
