"""Flags, --help, YAML config, and bad input: each gives a clear error and exit code 2."""

from __future__ import annotations

import dataclasses
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
    for flag in ("--rm-url", "--rm-batch-size", "--rm-max-concurrency", "--rm-retries", "--use-wandb", "--wandb-project",
                 "--wandb-group", "--wandb-mode", "--wandb-run-name", "debug modes:", "--debug-rollout-only",
                 "--debug-train-only", "--save-debug-rollout-data", "--load-debug-rollout-data",
                 "--policy-loss {ppo_clip,cispo}", "--dynamic-sampling-filter-path", "--over-sampling-batch-size",
                 "--max-dynamic-sampling-draws", "--overlong-buffer-len", "--overlong-penalty-factor", "--profile-step"):
        assert flag in out, flag
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
    (["--rm-url", "http://127.0.0.1:9/score"], "--rm-url and --rm-type"),
    (["--debug-train-only"], "--load-debug-rollout-data"),
    (["--wandb-mode", "offline"], "--use-wandb"),
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


# ---- a reward that never returns (--rm-timeout) ----

def test_reward_that_never_returns_times_out_and_the_process_exits(tiny_model, arith_data, tmp_path):
    rm = tmp_path / "rm.py"
    rm.write_text("import time\ndef stuck(sample):\n    time.sleep(10**6)\n")
    cmd = [sys.executable, "-m", "polyrl", "train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"],
           "--custom-rm-path", f"{rm}:stuck", "--rm-timeout", "0.5", "--quiet", "--num-rollout", "2", "--rollout-batch-size", "2",
           "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--run-dir", str(tmp_path / "run")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)  # 8 calls x 0.5 s; the stuck threads must not hold the exit
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["reward/timeouts"] for r in rows] == [4.0, 4.0] and all(r["reward/mean"] == 0.0 for r in rows)
    assert out.stderr.count("did not return within --rm-timeout 0.5s") == 1  # the first one, logged with its sample


# ---- every bad value is a clear error (exit 2, naming the flag), before anything starts ----

@pytest.mark.parametrize("argv, needle", [
    (["--lr", "-1"], "--lr must be > 0 (got -1.0)"),
    (["--lr", "0"], "--lr must be > 0"),
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--min-lr=-1e-6"], "--min-lr must be >= 0"),
    (["--adam-beta1", "1"], "--adam-beta1 must be in [0, 1)"),
    (["--adam-beta2", "-0.1"], "--adam-beta2 must be in [0, 1)"),
    (["--adam-eps", "0"], "--adam-eps must be > 0"),
    (["--weight-decay", "-0.01"], "--weight-decay must be >= 0"),
    (["--clip-grad", "-1"], "--clip-grad must be >= 0"),
    (["--lr-warmup-steps", "-1"], "--lr-warmup-steps must be >= 0"),
    (["--rollout-temperature", "-0.5"], "--rollout-temperature must be >= 0"),
    (["--eval-temperature", "-1"], "--eval-temperature must be >= 0"),
    (["--rollout-top-k", "0"], "--rollout-top-k must be -1 (off) or >= 1"),
    (["--rollout-top-p", "0"], "--rollout-top-p must be in (0, 1]"),
    (["--rollout-max-response-len", "0"], "--rollout-max-response-len must be >= 1"),
    (["--rollout-max-prompt-len", "0"], "--rollout-max-prompt-len must be >= 1"),
    (["--n-samples-per-prompt", "0"], "--n-samples-per-prompt must be >= 1"),
    (["--num-rollout", "-1"], "--num-rollout must be >= 0"),
    (["--save-interval", "-1"], "--save-interval must be >= 0"),
    (["--eval-interval", "-2"], "--eval-interval must be >= 0"),
    (["--ref-update-interval", "-1"], "--ref-update-interval must be >= 0"),
    (["--eps-clip", "0"], "--eps-clip must be > 0"),
    (["--eps-clip-high", "-0.2"], "--eps-clip-high must be > 0"),
    (["--gamma", "1.5"], "--gamma must be in [0, 1]"),
    (["--kl-loss-coef", "-1"], "--kl-loss-coef must be >= 0"),
    (["--rm-timeout", "-1"], "--rm-timeout must be >= 0"),
    (["--max-ckpt-to-keep", "0"], "--max-ckpt-to-keep must be >= 1"),
    (["--seed", "-1"], "--seed must be in [0, 2**32)"),
    (["--rollout-stop-token-ids", "3", "-5"], "--rollout-stop-token-ids must be >= 0 (got -5)"),
    (["--logprob-chunk-size", "0"], "--logprob-chunk-size must be >= 1"),
])
def test_out_of_range_values_exit_2_naming_the_flag(argv, needle, tiny_model, arith_data, capsys, monkeypatch):
    monkeypatch.setattr("polyrl.assemble.setup_command", lambda cfg: pytest.fail("validation must stop the run before set-up"))
    assert main(["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--rm-type", "arithmetic", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_every_numeric_setting_has_a_range():
    import dataclasses

    from polyrl.config import VALUE_RANGES, _base_type, _sections
    numeric = {f.name for _, cls in _sections() for f in dataclasses.fields(cls) if _base_type(f.type)[0] in (int, float)}
    assert numeric - VALUE_RANGES.keys() == set(), "add these settings to config.VALUE_RANGES"
    assert VALUE_RANGES.keys() - numeric == set(), "VALUE_RANGES names settings that do not exist"


def test_yaml_values_are_type_and_choice_checked_too(tiny_model, arith_data, tmp_path):
    y = tmp_path / "run.yaml"
    base = ["--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--rm-type", "arithmetic", "--config", str(y)]
    y.write_text("lr: 1e-5\nrollout_batch_size: 16.0\n")  # YAML 1.1 reads 1e-5 as a string; 16.0 is a whole number
    cfg = cfg_of(*base)
    validate(cfg)
    assert cfg.optimizer.lr == 1e-5 and cfg.rollout.rollout_batch_size == 16 and type(cfg.rollout.rollout_batch_size) is int
    for text, needle in [("lr: fast\n", "--lr 'fast' is not a number"), ("rollout_batch_size: 2.5\n", "--rollout-batch-size 2.5 is not an integer"),
                         ("lr_decay_style: exponential\n", "--lr-decay-style 'exponential' is not one of constant, linear, cosine"),
                         ("use_kl_loss: true\nkl_loss_coef: true\n", "--kl-loss-coef True is not a number")]:
        y.write_text(text)
        with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            validate(cfg_of(*base))


@pytest.mark.parametrize("content, needle", [
    ((), "--hf-checkpoint {d}: no config.json"),
    (("config.json",), "--hf-checkpoint {d}: no tokenizer"),
    (("config.json", "tokenizer.json"), "--hf-checkpoint {d}: no weights"),
])
def test_hf_checkpoint_without_config_tokenizer_or_weights(content, needle, arith_data, tmp_path, capsys):
    d = tmp_path / "model"
    d.mkdir()
    for name in content:
        (d / name).write_text("{}")
    assert main(["train", "--hf-checkpoint", str(d), "--prompt-data", arith_data["train"], "--rm-type", "arithmetic"]) == 2
    err = capsys.readouterr().err
    assert needle.format(d=d) in err and "Traceback" not in err
    assert main(["train", "--hf-checkpoint", str(tmp_path / "nope"), "--prompt-data", arith_data["train"], "--rm-type", "arithmetic"]) == 2
    assert "--hf-checkpoint" in capsys.readouterr().err


def test_ref_load_is_checked_like_hf_checkpoint(tiny_model, arith_data, tmp_path, capsys):
    (tmp_path / "ref").mkdir()
    assert main(["train", "--hf-checkpoint", tiny_model, "--ref-load", str(tmp_path / "ref"), "--prompt-data", arith_data["train"],
                 "--rm-type", "arithmetic"]) == 2
    assert f"--ref-load {tmp_path / 'ref'}: no config.json" in capsys.readouterr().err


@pytest.mark.parametrize("path, needle", [
    ("nosuchmod:fn", "--custom-rm-path 'nosuchmod:fn': could not import 'nosuchmod'"),
    ("polyrl.rewards:no_such_fn", "has no function 'no_such_fn'"),
    ("{tmp}/missing.py:f", "could not import"),
    ("{tmp}/broken.py:f", "ZeroDivisionError"),
])
def test_custom_reward_is_imported_before_anything_starts(path, needle, tiny_model, arith_data, tmp_path, capsys, monkeypatch):
    (tmp_path / "broken.py").write_text("x = 1 / 0\n")
    monkeypatch.setattr("polyrl.assemble.setup_command", lambda cfg: pytest.fail("validation must stop the run before the process group"))
    for command in ("train", "eval"):
        assert main([command, "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"],
                     "--custom-rm-path", path.format(tmp=tmp_path)]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err


def test_unknown_rm_type_is_a_config_error(tiny_model, arith_data, capsys):
    assert main(["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--rm-type", "nope"]) == 2
    assert "--rm-type 'nope' is unknown" in capsys.readouterr().err


# ---- runs that train nothing say so; resumes say from where ----

def test_num_rollout_0_says_nothing_to_train(tiny_model, arith_data, tmp_path, capsys):
    assert _train(tiny_model, arith_data["train"], tmp_path, "--num-rollout", "0") == 0
    err = capsys.readouterr().err
    assert "nothing to train: --num-rollout 0" in err
    assert "no metrics (no step was logged)" in err and "metrics.jsonl" not in err  # none was written
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_response_cap_beyond_the_models_context_is_warned_about_once(tiny_model, arith_data, tmp_path, capsys):
    assert _train(tiny_model, arith_data["train"], tmp_path, "--num-rollout", "0", "--rollout-max-response-len", "100") == 0
    err = capsys.readouterr().err
    assert err.count("WARNING --rollout-max-response-len 100 is beyond the model's context of 64 tokens") == 1
    assert _train(tiny_model, arith_data["train"], tmp_path, "--num-rollout", "0", "--rollout-max-response-len", "8") == 0
    assert "WARNING" not in capsys.readouterr().err


def test_load_logs_step_and_path_and_says_when_nothing_is_left(tiny_model, arith_data, tmp_path, capsys):
    ck = tmp_path / "ck"
    assert _train(tiny_model, arith_data["train"], tmp_path, "--save", str(ck), "--num-rollout", "2") == 0
    capsys.readouterr()
    step = os.path.abspath(ck / "step_000002")
    for n in ("2", "1"):  # at, and past, the checkpoint's step
        assert _train(tiny_model, arith_data["train"], tmp_path, "--load", str(ck), "--num-rollout", n) == 0
        err = capsys.readouterr().err
        assert f"loaded checkpoint {step} (step 2)" in err
        assert f"nothing to train: the checkpoint is at step 2, at or past --num-rollout {n}" in err
    assert _train(tiny_model, arith_data["train"], tmp_path, "--load", str(ck), "--num-rollout", "3") == 0
    err = capsys.readouterr().err
    assert f"loaded checkpoint {step} (step 2)" in err and "resuming at step 3 of --num-rollout 3" in err


# ---- checkpoint housekeeping ----

def test_max_ckpt_to_keep_and_stale_temporaries(tiny_model, arith_data, tmp_path):
    ck = tmp_path / "ck"
    os.makedirs(ck / "step_000007.tmp" / "dcp")  # a save killed half-way, in an earlier run
    assert _train(tiny_model, arith_data["train"], tmp_path, "--save", str(ck), "--save-interval", "1", "--num-rollout", "3",
                  "--max-ckpt-to-keep", "2") == 0
    assert sorted(os.listdir(ck)) == ["latest", "step_000002", "step_000003"]
    assert open(ck / "latest").read() == "step_000003"
    assert _train(tiny_model, arith_data["train"], tmp_path, "--load", str(ck), "--num-rollout", "4") == 0  # still loadable


def test_micro_batches_default_to_a_token_budget_on_gpu_and_8_samples_on_cpu():
    from polyrl.backends.base import plan_micro_batches
    from polyrl.config import GPU_TOKEN_BUDGET, BatchConfig
    b = BatchConfig()
    assert b.micro_batch_plan("cpu", 300) == {"micro_batch_size": 8}
    assert b.micro_batch_plan("cuda", 300) == {"max_tokens": GPU_TOKEN_BUDGET}
    assert b.micro_batch_plan("cuda", GPU_TOKEN_BUDGET + 5) == {"max_tokens": GPU_TOKEN_BUDGET + 5}  # never too small
    assert BatchConfig(micro_batch_size=4).micro_batch_plan("cuda", 300) == {"micro_batch_size": 4}  # the user's choice wins
    assert BatchConfig(max_tokens_per_gpu=1000).micro_batch_plan("cuda", 300) == {"max_tokens": 1000}
    assert BatchConfig(use_dynamic_batch_size=True, max_tokens_per_gpu=64).micro_batch_plan("cpu", 9) == {"max_tokens": 64}
    # 128 samples of ~300 tokens: 3 token-balanced micro-batches on GPU instead of 16 of 8 samples
    lens = [290 + i % 20 for i in range(128)]
    plans = plan_micro_batches(lens, **b.micro_batch_plan("cuda", max(lens)))
    assert len(plans) == 3 and sorted(i for p in plans for i in p) == list(range(128))
    assert all(sum(lens[i] for i in p) <= GPU_TOKEN_BUDGET for p in plans)


def test_compile_defaults_on_for_dense_cuda_decoders_only():
    from polyrl.config import ModelConfig
    m = ModelConfig()
    assert m.compiled("cuda", "qwen2") and m.compiled("cuda", "llama")
    assert not m.compiled("cpu", "qwen2")
    # Qwen3-Next's DeltaNet loops and HF MoE blocks spent minutes in the compiler on an H100: eager unless asked
    assert not m.compiled("cuda", "qwen3_next") and not m.compiled("cuda", "qwen3_moe")
    assert ModelConfig(compile=True).compiled("cpu", "qwen3_next") and not ModelConfig(compile=False).compiled("cuda", "qwen2")


def test_gpu_token_budget_follows_memory_model_and_state():
    """The default GPU micro-batch budget from the device's memory: the sizes the formula gives for the benchmark
    shapes (arithmetic in gpu_token_budget's docstring), clamped to [16384, 65536], and the floor under offload."""
    from types import SimpleNamespace

    from polyrl.config import GPU_TOKEN_BUDGET, GPU_TOKEN_BUDGET_MAX, BatchConfig, gpu_token_budget
    q05 = SimpleNamespace(hidden_size=896, num_hidden_layers=24, intermediate_size=4864)
    q15 = SimpleNamespace(hidden_size=1536, num_hidden_layers=28, intermediate_size=8960)
    h100, h200 = 81079 * 2**20, 143771 * 2**20  # total_memory of an H100 80 GB / an H200
    kw = dict(checkpointing=False, offload=False)
    full = 16  # bytes per trained parameter: FP32 weight, grad, two Adam moments
    b05 = gpu_token_budget(q05, h100, state_bytes=full * 494_032_768, **kw)
    # 0.8 x 85.0e9 - 7.9e9 = 60.1e9 bytes over 2 x (6 x 896 + 3 x 4864) x 24 = 958,464 bytes per token: 62.7k -> 61440
    assert b05 == 61440
    # 68.0e9 - 24.7e9 = 43.3e9 over 2,021,376 bytes per token: 21.4k -> 20480
    assert gpu_token_budget(q15, h100, state_bytes=full * 1_543_714_304, **kw) == 20480
    assert gpu_token_budget(q15, h100, state_bytes=2 * full * 1_543_714_304, **kw) == GPU_TOKEN_BUDGET  # 9.2k: the floor
    # the benchmark's 1.5B shape (untied head, 1.777B parameters): 68.0e9 - 28.4e9 = 39.6e9 bytes: 19.6k -> the floor
    # eager, 21.8k -> 20480 compiled (0.9 x 2,021,376 bytes per token)
    assert gpu_token_budget(q15, h100, state_bytes=full * 1_777_088_000, **kw) == GPU_TOKEN_BUDGET
    assert gpu_token_budget(q15, h100, state_bytes=full * 1_777_088_000, compiled=True, **kw) == 20480
    assert gpu_token_budget(q05, h200, state_bytes=full * 494_032_768, **kw) == GPU_TOKEN_BUDGET_MAX  # 118k: the cap
    assert gpu_token_budget(q15, h200, state_bytes=full * 1_543_714_304, **kw) == 45056
    # a co-resident critic's state (as much again) leaves less room
    assert gpu_token_budget(q15, h200, state_bytes=2 * full * 1_543_714_304, **kw) == 32768
    # checkpointing stores one block plus each layer's input: more tokens fit
    assert gpu_token_budget(q15, h100, state_bytes=full * 1_543_714_304, checkpointing=True, offload=False) == GPU_TOKEN_BUDGET_MAX
    # MoE: top-k experts' widths when wider than the dense MLP (8 x 768 > 6144 would be; here 8 x 1536 = 12288)
    moe = SimpleNamespace(hidden_size=896, num_hidden_layers=24, intermediate_size=4864, num_experts_per_tok=8,
                          moe_intermediate_size=1536)
    assert gpu_token_budget(moe, h100, state_bytes=full * 494_032_768, **kw) < b05
    assert gpu_token_budget(q05, h200, state_bytes=1, checkpointing=False, offload=True) == GPU_TOKEN_BUDGET
    assert gpu_token_budget(SimpleNamespace(), h200, state_bytes=1, **kw) == GPU_TOKEN_BUDGET
    assert BatchConfig().micro_batch_plan("cuda", 300, b05) == {"max_tokens": b05}
    assert BatchConfig(max_tokens_per_gpu=1000).micro_batch_plan("cuda", 300, b05) == {"max_tokens": 1000}
    assert BatchConfig().micro_batch_plan("cuda", 70_000, b05) == {"max_tokens": 70_000}  # never below the longest sample


def test_fsdp_backend_sizes_its_budget_from_what_the_gpu_holds(monkeypatch):
    """The FSDP backend's first-forward sizing on a (faked) 80 GiB GPU: memory allocated now + what other processes
    hold + the grads and Adam moments still to come is the state; an engine server holding 60 GiB beside the trainer
    leaves the floor. torch.cuda's memory queries and the model config are faked (this runs on CPU); the arithmetic is
    gpu_token_budget's."""
    from types import SimpleNamespace

    import torch

    from polyrl.backends.fsdp import backend as fb
    from polyrl.config import GPU_TOKEN_BUDGET, BatchConfig, ModelConfig, gpu_token_budget
    total, gib = 80 * 2**30, 2**30
    q05 = SimpleNamespace(hidden_size=896, num_hidden_layers=24, intermediate_size=4864)
    monkeypatch.setattr(fb.dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: gib)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1000))])

    def budget(others: int) -> int:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - 2 * gib - others, total))
        fake = SimpleNamespace(token_budget=None, device=torch.device("cuda", 0), optimizer=opt, dims=SimpleNamespace(dp=1),
                               mcfg=ModelConfig(hf_checkpoint="unused"), bcfg=BatchConfig(), role="actor", hf_config=q05)
        return fb.FSDPBackend._token_budget(fake)

    alone = budget(0)
    # 0.8 x 85.9e9 - 1.07e9 over 958,464 bytes per token: 70.6k tokens, the cap
    assert alone == gpu_token_budget(q05, total, state_bytes=gib + 12 * 1000, checkpointing=False, offload=False) == 65536
    assert budget(60 * gib) == GPU_TOKEN_BUDGET  # an engine server's 60 GiB on the same GPU
    assert GPU_TOKEN_BUDGET < budget(20 * gib) < alone


# ---- what each command takes -------------------------------------------------------------------------
def test_serve_refuses_flags_the_server_does_not_read(capsys):
    from polyrl.cli import main
    assert main_exit(main, ["serve", "--rollout-batch-size", "4"]) == 2
    assert "unrecognized arguments: --rollout-batch-size" in capsys.readouterr().err
    for flag in ("--prompt-data", "--train-backend", "--use-fault-tolerance", "--rollout-num-gpus-per-engine", "--lr"):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["serve", flag, "1"])
        assert e.value.code == 2, flag


def main_exit(main, argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's parser.error
        return e.code


def test_serve_takes_exactly_the_fields_serve_reads(tiny_model, monkeypatch):
    """Runs polyrl.rollout.server.serve on a config whose sections record every field read (the engine is built for
    real on CPU; the HTTP server and its event loop are stubbed), and compares what it read with what `polyrl serve`
    accepts: a field read but not accepted cannot be set, one accepted but not read is ignored."""
    import dataclasses

    from polyrl.cli import COMMANDS
    from polyrl.config import Config
    from polyrl.rollout import server as srv

    read: set[str] = set()

    def recording(section: str, obj):
        return _recording(section, obj, read)

    cfg = config_from_args(build_parser().parse_args(["serve", "--hf-checkpoint", tiny_model, "--device", "cpu"]))
    for f in dataclasses.fields(Config):
        setattr(cfg, f.name, recording(f.name, getattr(cfg, f.name)))
    handed = {}
    monkeypatch.setattr(srv, "EngineServer", lambda engine, s, **kw: handed.update(engine=engine, server=s, **kw))
    monkeypatch.setattr(srv.asyncio, "run", lambda coro: coro.close())  # no socket, no event loop
    assert srv.serve(cfg) == 0
    assert handed["server"] is cfg.server  # the server section goes whole to EngineServer, which reads it per request
    accepted = COMMANDS["serve"][2]
    server_fields = {f"server.{f.name}" for f in dataclasses.fields(type(cfg.server))}
    assert read - server_fields == accepted - server_fields
    actions = {a.dest for a in build_parser()._subparsers._group_actions[0].choices["serve"]._actions if "." in a.dest}
    assert actions == accepted


def test_no_flag_is_matched_by_its_prefix(tiny_model, arith_data):
    """allow_abbrev is off: a prefix of a polyrl flag is unknown (train passes --sglang-X through to SGLang)."""
    p = build_parser()
    with pytest.raises(SystemExit):
        p.parse_args(["train", "--rollout-batch", "4"])
    args, extras = p.parse_known_args(["train", "--sglang-router", "x"])
    assert extras == ["--sglang-router", "x"] and not hasattr(args, "engines.sglang_router_policy")


def test_help_shows_value_kinds_not_config_paths_and_a_short_usage():
    out = subprocess.run([sys.executable, "-m", "polyrl", "train", "--help"], capture_output=True, text=True, timeout=60).stdout
    assert out.startswith("usage: polyrl train [options]\n")
    assert "--rollout-batch-size N" in out and "--hf-checkpoint PATH" in out and "--rm-url URL" in out
    assert "ROLLOUT." not in out and "MODEL." not in out and "_" not in out.split("\n", 1)[0]


@pytest.mark.parametrize("command, flags", [
    ("eval", ["--lr", "5"]), ("eval", ["--num-epoch", "3"]), ("eval", ["--micro-batch-size", "2"]),
    ("eval", ["--save", "CK"]), ("eval", ["--rollout-batch-size", "4"]), ("eval", ["--use-tensorboard"]),
    ("export-hf", ["--lr", "5"]), ("export-hf", ["--num-epoch", "3"]), ("export-hf", ["--global-batch-size", "2"]),
    ("export-hf", ["--save", "CK"]),
])
def test_eval_and_export_refuse_flags_they_do_not_read(command, flags, tiny_model, arith_data, tmp_path, capsys):
    from polyrl.cli import main
    flags = [str(tmp_path / "ck") if f == "CK" else f for f in flags]
    base = (["--eval-prompt-data", arith_data["eval"], "--rm-type", "arithmetic"] if command == "eval" else
            ["--load", str(tmp_path), "--save-hf", str(tmp_path / "out")])
    assert main_exit(main, [command, "--hf-checkpoint", tiny_model, *base, *flags]) == 2
    assert flags[0] in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, *flags])
    assert not (tmp_path / "out").exists()


def test_eval_and_export_accept_every_setting_they_read(tiny_model, arith_data, tmp_path, monkeypatch):
    """Runs run_eval (with and without --load) and run_export on configs whose sections record every field read, and
    checks that each command accepts every field it read of the sections it takes (outside the backend's optimizer and
    batching, which a model that takes no step never uses)."""
    import dataclasses

    from polyrl import assemble as asm
    from polyrl.checkpoint import save_checkpoint
    from polyrl.cli import COMMANDS, run_eval, run_export
    from polyrl.config import Config

    read: set[str] = set()

    def recording(section: str, obj):
        return _recording(section, obj, read)

    def trace(fn, argv):
        cfg = config_from_args(build_parser().parse_args(argv))
        validate(cfg, argv[0])
        for f in dataclasses.fields(Config):
            setattr(cfg, f.name, recording(f.name, getattr(cfg, f.name)))
        read.clear()
        fn(cfg)
        taken = COMMANDS[argv[0]][1]
        return {r for r in read if r.split(".")[0] in taken}

    cfg = config_from_args(build_parser().parse_args(["train", "--hf-checkpoint", tiny_model, "--device", "cpu"]))
    device, _ = asm.setup_command(cfg)
    save_checkpoint(str(tmp_path / "ck"), 1, asm.build_backend(cfg, device, total_steps=1, need_ref=False),
                    {"step": 1, "data": {}, "config": {}})
    ev = ["eval", "--hf-checkpoint", tiny_model, "--eval-prompt-data", arith_data["eval"] + "@[:4]", "--rm-type",
          "arithmetic", "--device", "cpu", "--run-dir", str(tmp_path / "ev"), "--rollout-max-response-len", "2"]
    for fn, argv in ((run_eval, ev), (run_eval, ev + ["--load", str(tmp_path / "ck")]),
                     (run_export, ["export-hf", "--hf-checkpoint", tiny_model, "--load", str(tmp_path / "ck"),
                                   "--save-hf", str(tmp_path / "out"), "--device", "cpu"])):
        missing = trace(fn, argv) - COMMANDS[argv[0]][2]
        assert missing == set(), (argv[0], missing)


def test_yaml_settings_a_command_does_not_use_are_refused(tmp_path, tiny_model, capsys):
    """A YAML file cannot slip in what the command's flags would refuse: polyrl serve reads no learning rate, polyrl sft
    no rollout settings. Exit 2 naming the file, the setting and its flag."""
    from polyrl.cli import main

    (tmp_path / "serve.yaml").write_text("optimizer:\n  lr: 0.5\n")
    assert main(["serve", "--config", str(tmp_path / "serve.yaml"), "--hf-checkpoint", tiny_model]) == 2
    assert "polyrl serve does not use optimizer.lr (--lr)" in capsys.readouterr().err
    (tmp_path / "sft.yaml").write_text("rollout_temperature: 0.7\n")
    assert main(["sft", "--config", str(tmp_path / "sft.yaml"), "--hf-checkpoint", tiny_model]) == 2
    assert "polyrl sft does not use rollout.rollout_temperature (--rollout-temperature)" in capsys.readouterr().err
    cfg = config_from_args(build_parser().parse_args(["train", "--config", str(tmp_path / "sft.yaml")]))
    assert cfg.rollout.rollout_temperature == 0.7  # train reads it


def _recording(section: str, obj, read: set[str]):
    """A copy of the config section `obj` that adds "section.field" to `read` for every field read from it."""
    cls = type(obj)
    names = {f.name for f in dataclasses.fields(cls)}

    def getattribute(self, k):
        if k in names:
            read.add(f"{section}.{k}")
        return object.__getattribute__(self, k)
    rec = type("Recording" + cls.__name__, (cls,), {"__getattribute__": getattribute})
    return rec(**{n: object.__getattribute__(obj, n) for n in names})
