"""The bench scripts parse their flags and answer --help without running a benchmark,
and without TRL installed (it is imported only inside the TRL runner)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
SCRIPTS = ["compare_trl.py", "weight_sync.py", "train_throughput.py", "offload_train.py"]
# Runs a script with `import trl` (and torch, for --help) made to fail, as on a machine without them.
NO_TRL = ("import sys, runpy; sys.modules['trl'] = None; sys.modules['torch'] = None; "
          "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name[:-3]}", os.path.join(BENCH, name))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_runs_without_trl_or_torch(script):
    out = subprocess.run([sys.executable, "-c", NO_TRL, os.path.join(BENCH, script), "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout and "--device" in out.stdout


def test_compare_trl_dry_run_without_trl():
    out = subprocess.run([sys.executable, "-c", NO_TRL, os.path.join(BENCH, "compare_trl.py"), "--dry-run",
                          "--prompts-per-step", "4", "--samples-per-prompt", "2", "--beta", "0.04"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    trl = plan["trl_grpo_config"]
    assert trl["num_generations"] == 2 and trl["beta"] == 0.04 and trl["use_vllm"] is False
    assert trl["per_device_train_batch_size"] * trl["gradient_accumulation_steps"] == 8  # one optimizer step per generation
    argv = plan["polyrl_argv"]
    assert argv[argv.index("--rollout-batch-size") + 1] == "4" and "--use-kl-loss" in argv


def test_compare_trl_parse_args():
    ct = load("compare_trl.py")
    a = ct.parse_args(["--device", "cpu", "--steps", "4", "--warmup", "1", "--frameworks", "polyrl,trl",
                       "--model-shape", "tiny", "--sft-warmstart-epochs", "2", "--out", "x.json"])
    assert a.framework_list == ["polyrl", "trl"] and a.steps == 4 and a.sft_warmstart_epochs == 2
    assert a.micro_batch_size == 64  # default, within 32 prompts x 8 samples
    assert ct.main(["--dry-run"]) == 0
    for bad in (["--frameworks", "polyrl,vllm"], ["--samples-per-prompt", "1"], ["--micro-batch-size", "12"],
                ["--model-shape", "qwen2.5-72b"]):
        with pytest.raises(SystemExit) as e:
            ct.parse_args(bad)
        assert e.value.code == 2


def test_trl_settings_match_polyrl():
    ct = load("compare_trl.py")
    s = dict(device="cpu", prompts_per_step=8, samples_per_prompt=4, max_new_tokens=6, micro_batch_size=16, lr=3e-4,
             beta=0.0, seed=7, total_steps=5, model_dir="m", train_data="t.jsonl", run_dir="r")
    kw = ct.trl_config_kwargs(s)
    assert (kw["gradient_accumulation_steps"], kw["max_completion_length"], kw["learning_rate"], kw["seed"]) == (2, 6, 3e-4, 7)
    assert kw["bf16"] is False and kw["use_cpu"] is True and kw["report_to"] == "none" and kw["logging_steps"] == 1
    argv = ct.polyrl_argv(s)
    assert argv[argv.index("--micro-batch-size") + 1] == "16" and "--use-kl-loss" not in argv
    assert ct.trl_config_kwargs({**s, "device": "cuda"}, continuous_batching=True, cb_field="use_transformers_paged")[
        "use_transformers_paged"] is True


def test_weight_sync_parse_args():
    ws = load("weight_sync.py")
    assert ws.parse_args([]).shapes == ["tiny", "qwen2.5-0.5b"]
    assert ws.parse_args(["--device", "cuda"]).shapes == ["qwen2.5-0.5b", "qwen2.5-1.5b"]
    assert ws.main(["--dry-run", "--model-shapes", "tiny"]) == 0
    with pytest.raises(SystemExit):
        ws.parse_args(["--model-shapes", "gpt2"])


@pytest.mark.parametrize("script", ["rollout_throughput.py", "engine_cycle.py"])
def test_gpu_engine_bench_help_without_torch(script):
    out = subprocess.run([sys.executable, "-c", NO_TRL, os.path.join(BENCH, script), "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout


def test_train_throughput_parse_args():
    a = load("train_throughput.py").parse_args(["--model-shape", "tiny", "--tokens", "512", "1024", "--variants", "base,compile"])
    assert a.model_shape == ["tiny"] and a.tokens == [512, 1024] and a.variants.split(",") == ["base", "compile"]


def test_compare_trl_budgets_and_trl_steps():
    ct = load("compare_trl.py")
    assert ct.parse_budgets("polyrl=90,trl=180") == {"polyrl": 90.0, "trl": 180.0}
    assert ct.parse_budgets("120,trl-cb=60") == {"*": 120.0, "trl-cb": 60.0}
    a = ct.parse_args(["--device", "cuda", "--steps", "8", "--warmup", "2", "--trl-steps", "2", "--trl-warmup", "1",
                       "--row-budget", "polyrl=90,trl=180", "--deadline", "430"])
    assert a.framework_list == ["polyrl", "trl", "trl-cb"] and a.budgets == {"polyrl": 90.0, "trl": 180.0}
    assert ct.parse_args(["--device", "cpu"]).framework_list == ["polyrl", "trl"]
    plan = {"warmup": 2, "steps": 8, "total_steps": 10, "trl_warmup": 1, "trl_steps": 2}
    assert ct.framework_plan(plan, "trl-cb")["total_steps"] == 3 and ct.framework_plan(plan, "polyrl")["total_steps"] == 10
    for bad in (["--row-budget", "vllm=5"], ["--row-budget", "trl=x"], ["--trl-steps", "0"]):
        with pytest.raises(SystemExit) as e:
            ct.parse_args(bad)
        assert e.value.code == 2
    # a run stopped by its budget before any measured step reports its warm-up steps, marked
    res = {"steps": [{"step": 1, "step_s": 60.0, "gen_s": 50.0, "completion_tokens": 1000.0, "reward": 0.0}],
           "stopped": "row budget: stopped after step 1 of 3", "peak_gpu_mib": 1.0}
    row = ct.summarize("trl", [res], {"warmup": 1, "reward_last_k": 5}, [100])
    assert row["warmup_in_median"] and row["step_s_median"] == 60.0 and row["stopped"].startswith("row budget")
    assert abs(row["trained_tokens_per_s"] - 1100.0 / 60.0) < 1e-9


def test_decode_kernels_help_without_torch():
    out = subprocess.run([sys.executable, "-c", NO_TRL, os.path.join(BENCH, "decode_kernels.py"), "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--sweep" in out.stdout and "--baseline-ops" in out.stdout
    a = load("decode_kernels.py").parse_args(["--batch", "64", "256", "--sweep"])
    assert a.batch == [64, 256] and a.sweep and a.block_size == [16]  # the engine's page size unless asked
    assert load("decode_kernels.py").parse_args(["--block-size", "16", "64"]).block_size == [16, 64]
