"""Flags, --help, YAML config, and bad input: each gives a clear error and exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from polyrl.cli import build_parser, main
from polyrl.config import ConfigError, config_from_args, validate


def cfg_of(*argv):
    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_help_lists_flag_groups_with_defaults():
    out = subprocess.run([sys.executable, "-m", "polyrl", "train", "--help"], capture_output=True, text=True).stdout
    for group in ("cluster / backend:", "data:", "rollout:", "algorithm:", "reward:", "optimizer:", "model / backend:", "checkpoints:"):
        assert group in out
    assert "--rollout-batch-size" in out and "(default: 8)" in out and "--eps-clip-c" in out
    sft = subprocess.run([sys.executable, "-m", "polyrl", "sft", "--help"], capture_output=True, text=True).stdout
    assert "--response-key" in sft and "--n-samples-per-prompt" not in sft


def test_yaml_sets_fields_and_flags_override(tmp_path):
    y = tmp_path / "run.yaml"
    y.write_text("rollout:\n  rollout_batch_size: 16\n  n_samples_per_prompt: 2\nlr: 0.5\nuse-kl-loss: true\n")
    cfg = cfg_of("--config", str(y), "--n-samples-per-prompt", "8")
    assert (cfg.rollout.rollout_batch_size, cfg.rollout.n_samples_per_prompt, cfg.optimizer.lr, cfg.algorithm.use_kl_loss) == (16, 8, 0.5, True)
    y.write_text("not_a_field: 1\n")
    with pytest.raises(ConfigError, match="not_a_field"):
        cfg_of("--config", str(y))


@pytest.mark.parametrize("argv, needle", [
    (["--rollout-batch-size", "3", "--n-samples-per-prompt", "3", "--global-batch-size", "4"], "--global-batch-size"),
    (["--eps-clip-c", "0.9"], "--eps-clip-c must be > 1"),
    (["--use-kl-loss"], "--kl-loss-coef"),
    (["--use-dynamic-batch-size"], "--max-tokens-per-gpu"),
    (["--fp16", "--bf16"], "--fp16, --bf16 and --fp32"),
    (["--group-rm"], "--group-rm"),
])
def test_invalid_combinations_name_the_flags(argv, needle, tiny_model, arith_data, capsys):
    base = ["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--rm-type", "arithmetic"]
    assert main(base + argv) == 2
    assert needle in capsys.readouterr().err


def test_unknown_choices_exit_2_listing_valid_values(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["train", "--advantage-estimator", "ppo2"])
    assert e.value.code == 2
    assert "grpo" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["train", "--train-backend", "deepspeed"])
    assert e.value.code == 2 and "fsdp" in capsys.readouterr().err


def test_megatron_without_its_requirements_is_a_clear_message(tiny_model, arith_data, capsys):
    pytest.importorskip("torch")
    import torch
    if torch.cuda.is_available() and sys.version_info >= (3, 12):
        pytest.skip("this machine may run megatron-core; the message is for machines that cannot")
    code = main(["train", "--train-backend", "megatron", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"],
                 "--rm-type", "arithmetic"])
    err = capsys.readouterr().err
    assert code == 2 and "pip install -e .[megatron]" in err and "Traceback" not in err


def _train(tiny_model, data, tmp_path, *extra):
    return main(["train", "--hf-checkpoint", tiny_model, "--prompt-data", data, "--rm-type", "arithmetic", "--quiet",
                 "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--run-dir", str(tmp_path / "run"), *extra])


def test_malformed_jsonl_names_file_and_line_and_nothing_trains(tiny_model, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "label": "2"}\n{"prompt": "2+2=", "label": \n')
    assert _train(tiny_model, str(bad), tmp_path) == 2
    assert f"{bad}:2" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")
    bad.write_text('{"prompt": "1+1=", "label": "2"}\n{"question": "2+2="}\n')
    assert _train(tiny_model, str(bad), tmp_path) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2" in err and "--input-key" in err


def test_empty_dataset_and_all_prompts_too_long(tiny_model, tmp_path, arith_data, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert _train(tiny_model, str(empty), tmp_path) == 2
    assert "no rows" in capsys.readouterr().err
    assert _train(tiny_model, arith_data["train"], tmp_path, "--rollout-max-prompt-len", "2") == 2
    assert "--rollout-max-prompt-len" in capsys.readouterr().err


def test_load_missing_or_truncated_checkpoint_overwrites_nothing(tiny_model, arith_data, tmp_path, capsys):
    assert _train(tiny_model, arith_data["train"], tmp_path, "--load", str(tmp_path / "nope")) == 2
    assert "--load" in capsys.readouterr().err
    ck = tmp_path / "ck"
    assert _train(tiny_model, arith_data["train"], tmp_path, "--save", str(ck)) == 0
    step = ck / "step_000001"
    os.remove(step / "dcp" / ".metadata")
    snapshot = sorted(os.listdir(step))
    assert _train(tiny_model, arith_data["train"], tmp_path, "--load", str(ck), "--save", str(ck), "--num-rollout", "2") == 2
    assert "truncated" in capsys.readouterr().err
    assert sorted(os.listdir(step)) == snapshot and not (ck / "step_000002").exists()
    (step / "COMPLETE").unlink()
    assert _train(tiny_model, arith_data["train"], tmp_path, "--load", str(step)) == 2
    assert "not a complete polyrl checkpoint" in capsys.readouterr().err


def test_interrupted_save_leaves_previous_checkpoint_loadable(tiny_model, arith_data, tmp_path):
    ck = tmp_path / "ck"
    assert _train(tiny_model, arith_data["train"], tmp_path, "--save", str(ck)) == 0
    os.makedirs(ck / "step_000002.tmp" / "dcp")  # a save killed half-way
    (ck / "step_000002.tmp" / "dcp" / "__0_0.distcp").write_bytes(b"\0" * 10)
    assert open(ck / "latest").read() == "step_000001"
    assert _train(tiny_model, arith_data["train"], tmp_path, "--load", str(ck), "--num-rollout", "2",
                  "--run-dir", str(tmp_path / "resumed")) == 0


def test_reward_that_raises_is_isolated_and_counted(tiny_model, arith_data, tmp_path):
    rm = tmp_path / "rm.py"
    rm.write_text("def bad(sample):\n    if sample.group_index == 0:\n        raise RuntimeError('boom')\n    return 1.0\n")
    assert main(["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--custom-rm-path", f"{rm}:bad",
                 "--quiet", "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                 "--run-dir", str(tmp_path / "run")]) == 0
    row = json.loads(open(tmp_path / "run" / "metrics.jsonl").readline())
    assert row["reward/errors"] == 2 and row["reward/mean"] == 0.5
