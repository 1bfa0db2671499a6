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
PROBES = os.path.join(BENCH, "probes")
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
    assert load("train_throughput.py").parse_args(["--busy"]).busy  # CUDA (the default device)
    with pytest.raises(SystemExit) as e:  # nothing to record on the CPU: refused, not ignored
        load("train_throughput.py").parse_args(["--busy", "--device", "cpu"])
    assert e.value.code == 2


def test_train_throughput_host_profile_names_the_functions_that_took_the_host(capsys):
    import cProfile
    tt = load("train_throughput.py")
    assert tt.parse_args(["--host-profile", "--device", "cpu"]).host_profile

    def busy_host_work():
        return sum(i * i for i in range(20000))
    prof = cProfile.Profile()
    prof.enable()
    busy_host_work()
    prof.disable()
    tt.print_host_profile(prof, "fsdp:exact:512", 0.5)
    out = capsys.readouterr().out
    assert out.startswith("host profile of fsdp:exact:512: 0.500 s step (profiled)") and "busy_host_work" in out


def test_train_throughput_block_cap_is_the_exact_rows_and_refused_elsewhere(capsys):
    tt = load("train_throughput.py")
    assert tt.block_cap("exact+cap32") == 32 and tt.block_cap("exact") is None and tt.block_cap("compile+ac") is None
    a = tt.parse_args(["--rows", "fsdp:exact:512", "fsdp:exact+cap32:512", "--device", "cpu"])
    assert [tt.block_cap(r.split(":")[1]) for r in a.rows] == [None, 32]
    for bad in ("fsdp:compile+cap32:512", "fsdp:exact+cap0:512", "fsdp:exact+cap8+cap16:512"):
        with pytest.raises(SystemExit) as e:  # a cap the row would not use is refused at start-up, not ignored
            tt.parse_args(["--rows", bad, "--device", "cpu"])
        assert e.value.code == 2 and "capN" in capsys.readouterr().err


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


def test_regress_help_and_dry_run_without_torch():
    for args in (["--help"], ["--dry-run"]):
        out = subprocess.run([sys.executable, "-c", NO_TRL, os.path.join(BENCH, "regress.py"), *args],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
    assert "rollout_throughput.py" in json.loads(out.stdout)["stages"]["rollout"]
    rg = load("regress.py")
    with pytest.raises(SystemExit) as e:
        rg.parse_args(["--only", "rollout,decode"])
    assert e.value.code == 2
    # the shipped baseline: an H100's, every metric at the script's own setting and cited
    base = rg.load_baseline(rg.DEFAULT_BASELINE)
    assert "H100" in base["device"] and set(base["metrics"]) == set(rg.METRICS)
    for key, rec in base["metrics"].items():
        assert rec["setting"] == rg.METRICS[key].setting and rec["value"] > 0
        assert rec["source"].startswith("bench/RESULTS.md") or rec["source"].startswith("measured by")
    # without --baseline each device kind gets its own shipped file, the H100's where a kind has none
    for device, path in rg.DEVICE_BASELINES.items():
        assert rg.baseline_path(None, device) == path and rg.load_baseline(path)["device"] == device
        assert set(rg.load_baseline(path)["metrics"]) == set(rg.METRICS)
    assert rg.baseline_path(None, "OTHER GPU") == rg.DEFAULT_BASELINE
    assert rg.baseline_path("/x.json", "NVIDIA H200") == "/x.json"


def test_regress_verdicts_follow_each_metrics_direction_and_band():
    rg = load("regress.py")
    tok, step = rg.METRICS["rollout_tok_s"], rg.METRICS["grpo_step_s"]  # bands 7% and 10%
    assert rg.verdict(tok, 92.0, 100.0)[1] == "slower" and rg.verdict(tok, 94.0, 100.0)[1].startswith("same")
    assert rg.verdict(tok, 108.0, 100.0)[1] == "faster"
    assert rg.verdict(step, 1.12, 1.0)[1] == "slower" and rg.verdict(step, 0.88, 1.0)[1] == "faster"
    assert rg.verdict(step, 1.05, 1.0) == (1.05, "same (within 10%)")
    assert rg.device_mismatch({"device": "NVIDIA H100 80GB HBM3"}, "NVIDIA H100 80GB HBM3") is None
    why = rg.device_mismatch({"device": "NVIDIA H100 80GB HBM3"}, "NVIDIA H200")
    assert "NVIDIA H100 80GB HBM3" in why and "NVIDIA H200" in why
    assert rg.device_mismatch(None, "NVIDIA H200") is None  # no baseline yet: --update starts one


def test_regress_grpo_step_is_the_median_after_warmup(tmp_path):
    rg = load("regress.py")
    p = tmp_path / "metrics.jsonl"
    rows = [{"step": i, "time/step": t, "time/rollout": 0.4, "time/train": 0.3} for i, t in
            enumerate([9.0, 5.0, 0.70, 0.72, 0.90, 0.71], start=1)]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 7, "time/st')  # a killed run's half line
    step, info = rg.grpo_step_from_metrics(str(p), warmup=2)
    assert step == 0.715 and "median of 4 steps" in info  # steps 3-6; warm-up and the broken line left out
    with pytest.raises(RuntimeError, match="3 needed"):
        rg.grpo_step_from_metrics(str(p), warmup=4)


# Stand-ins for the three GPU stages: each writes the file its reader parses, with the figure given in argv.
FAKE_STAGE = """
import json, os, sys, time
stage, work, value = sys.argv[1], sys.argv[2], float(sys.argv[3])
if value < 0:
    time.sleep(60)
elif stage == "rollout":
    json.dump({"engine": {"tok_s": value, "runs": [{"tok_s": value}], "roofline": {"tok_s": 4 * value}}},
              open(os.path.join(work, "rollout.json"), "w"))
elif stage == "train":
    open(os.path.join(work, "train.jsonl"), "a").write(json.dumps(
        {"mfu": value, "step_s": 0.3, "tokens_per_s": 1, "peak_mem_gib": 1.0}) + "\\n")
else:
    d = os.path.join(work, "grpo", "polyrl_run0")
    os.makedirs(d, exist_ok=True)
    open(os.path.join(d, "metrics.jsonl"), "w").write(
        "".join(json.dumps({"step": i, "time/step": value}) + "\\n" for i in range(1, 9)))
"""


def test_regress_compares_updates_and_refuses_another_device(tmp_path, monkeypatch, capsys):
    rg = load("regress.py")
    today = {"rollout": 90000.0, "train": 0.33, "grpo": 0.70}  # rollout 10% below its baseline: slower
    monkeypatch.setattr(rg, "stage_command", lambda stage, work: [sys.executable, "-c", FAKE_STAGE, stage, work,
                                                                  str(today[stage])])
    monkeypatch.setattr(rg, "gpu_name", lambda: "FAKE GPU")
    base = {"device": "FAKE GPU", "metrics": {k: {"value": v, "setting": rg.METRICS[k].setting, "date": "2026-01-01"}
                                              for k, v in (("rollout_tok_s", 100000.0), ("train_mfu", 0.32),
                                                           ("grpo_step_s", 0.80))}}
    path = tmp_path / "base.json"
    path.write_text(json.dumps(base))
    argv = ["--baseline", str(path), "--workdir", str(tmp_path / "w")]
    assert rg.main(argv + ["--update"]) == 1  # a slower metric fails the gate
    table = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
             for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "metric" not in line}
    assert table[rg.METRICS["rollout_tok_s"].label] == ["90,000", "100,000 (2026-01-01)", "0.900", "slower"]
    assert table[rg.METRICS["train_mfu"].label][2:] == ["1.031", "same (within 5%)"]
    assert table[rg.METRICS["grpo_step_s"].label][2:] == ["0.875", "faster"]  # 0.70 s against 0.80 s
    new = json.loads(path.read_text())
    assert new["device"] == "FAKE GPU" and new["metrics"]["rollout_tok_s"]["value"] == 90000.0
    assert new["metrics"]["grpo_step_s"]["command"] == "PYTHONPATH=. python3 bench/regress.py"
    # today's figures are now the baseline: the same run is "same" everywhere and passes
    assert rg.main(argv) == 0
    # a stage past its wall limit is killed and reported; --update then writes nothing
    monkeypatch.setitem(rg.STAGE_TIMEOUT_S, "train", 1)
    today["train"] = -1.0
    assert rg.main(argv + ["--only", "train", "--update"]) == 1
    out = capsys.readouterr()
    assert "FAILED" in out.out and "killed at its 1 s limit" in out.out and "not written" in out.err
    assert json.loads(path.read_text()) == new
    # another device kind: refused before anything runs, both names printed
    monkeypatch.setattr(rg, "gpu_name", lambda: "OTHER GPU")
    assert rg.main(argv) == 2
    err = capsys.readouterr().err
    assert "'FAKE GPU'" in err and "'OTHER GPU'" in err


def test_vlm_step_tiny_runs_a_grpo_step_with_images_on_cpu(tmp_path):
    """bench/vlm_step.py --tiny end to end: builds the tiny Qwen2.5-VL from its config, writes 56 x 56 images, runs one
    `polyrl train` step with --multimodal-keys on CPU and reports it. A 56-pixel side is 4 x 4 patches of 14, merged
    2 x 2: 4 image tokens per sample."""
    out = tmp_path / "vlm.json"
    res = subprocess.run([sys.executable, os.path.join(BENCH, "vlm_step.py"), "--tiny", "--workdir", str(tmp_path / "w"),
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["returncode"] == 0 and r["steps_measured"] == 1 and r["image_tokens_per_sample"] == 4
    assert r["prompt_tokens"] > r["image_tokens_per_sample"]  # the question's characters and the vision markers
    assert r["time/step"] > 0 and r["time/train"] > 0 and r["peak_rss_mib"] > 0
    assert "--multimodal-keys" in r["command"] and "--device cpu" in r["command"]
    assert "image / prompt tokens per sample" in res.stdout and "| 4 / " in res.stdout


def test_vlm_step_flags_and_help_without_torch():
    out = subprocess.run([sys.executable, "-c", NO_TRL, os.path.join(BENCH, "vlm_step.py"), "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--tiny" in out.stdout and "--device" in out.stdout
    vs = load("vlm_step.py")
    a = vs.parse_args([])  # the GPU row's defaults
    assert (a.device, a.prompts, a.samples, a.new_tokens, a.image_size) == ("cuda", 16, 8, 128, 448)
    assert a.polyrl_args == "--offload-train --gradient-checkpointing"
    assert vs.parse_args(["--tiny"]).polyrl_args == "" and vs.parse_args(["--tiny"]).device == "cpu"
    assert vs.QWEN25_VL_3B["text"]["vocab_size"] == 151936 and vs.QWEN25_VL_3B["vision"]["depth"] == 32
    for bad in (["--samples", "1"], ["--device", "tpu"], ["--steps", "0"]):
        with pytest.raises(SystemExit) as e:
            vs.parse_args(bad)
        assert e.value.code == 2


def test_true_on_policy_step_runs_both_modes_on_cpu(tmp_path):
    """bench/true_on_policy_step.py --device cpu end to end with the tiny model: both modes run, the exact one at a
    log-prob difference of exactly 0 (the default one's FP32 rounding is checked by tests/test_true_on_policy.py), and
    the table names both."""
    out = tmp_path / "top.json"
    res = subprocess.run([sys.executable, os.path.join(BENCH, "true_on_policy_step.py"), "--device", "cpu", "--shape",
                          "tiny", "--prompts", "4", "--samples", "2", "--new-tokens", "16", "--warmup", "1", "--steps",
                          "1", "--timeout", "240", "--out", str(out)],
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": os.path.dirname(BENCH)})
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["true_on_policy"]["train_rollout_logprob_abs_diff_max"] == 0.0
    assert r["default"]["train_rollout_logprob_abs_diff_max"] >= 0.0
    assert r["true_on_policy"]["steps_measured"] == r["default"]["steps_measured"] == 1
    # no CUDA graph on the CPU: every measured step is a steady one, and both ratios are the same figure
    assert r["true_on_policy"]["steps_steady"] == r["default"]["steps_steady"] == 1
    assert r["step_ratio_steady"] == r["step_ratio"]
    assert "step ratio (true-on-policy / default)" in res.stdout and "CPU" in res.stdout


def test_pack_host_prints_a_row_per_thread_count_on_cpu():
    env = {**os.environ, "PYTHONPATH": os.path.dirname(BENCH)}
    out = subprocess.run([sys.executable, os.path.join(BENCH, "pack_host.py"), "--device", "cpu", "--tokens", "512",
                          "--threads", "2", "1", "--repeats", "2"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    rows = [l for l in out.stdout.splitlines() if l.startswith("| ") and l[2].isdigit()]
    assert [r.split("|")[1].strip() for r in rows] == ["2", "1"]
    assert all(float(r.split("|")[2]) > 0 for r in rows)


def test_block_gemm_prints_a_row_per_linear_on_cpu():
    env = {**os.environ, "PYTHONPATH": os.path.dirname(BENCH)}
    out = subprocess.run([sys.executable, os.path.join(PROBES, "block_gemm.py"), "--device", "cpu", "--blocks", "2",
                          "--max-count", "2", "--repeats", "1", "--rows", "8"], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    rows = [l.split("|")[1].strip() for l in out.stdout.splitlines() if l.startswith("| ") and "_proj" in l]
    assert rows == ["q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"]


def test_score_pass_classes_kernels_and_refuses_a_cpu_machine():
    sys.path.insert(0, PROBES)
    import score_pass
    assert [score_pass.kernel_class(n) for n in ("nvjet_sm90_tst_96x128_64x7", "pytorch_flash::flash_fwd_kernel",
                                                  "rms_rows_kernel", "_row_stats_kernel", "triton_poi_fused_add_0",
                                                  "Memcpy DtoD", "vectorized_gather_kernel")] == [
        "gemm", "attention", "rms", "head", "elementwise/reduce", "copy", "elementwise/reduce"]
    env = {**os.environ, "PYTHONPATH": os.path.dirname(BENCH), "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, os.path.join(PROBES, "score_pass.py")], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 2 and "needs a CUDA GPU" in out.stderr


def test_prefix_attention_refuses_a_machine_without_the_varlen_kernel():
    env = {**os.environ, "PYTHONPATH": os.path.dirname(BENCH), "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, os.path.join(PROBES, "prefix_attention.py"), "--prompt-lens", "3"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and "needs a CUDA GPU" in out.stderr
    out = subprocess.run([sys.executable, os.path.join(PROBES, "prefix_attention.py"), "--help"], capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.returncode == 0 and "bottom right" in out.stdout


def test_exact_decode_reproduces_the_scoring_functions_log_probs_on_cpu():
    """probes/exact_decode.py on CPU (FP32, a 2-layer model): the step-by-step decode through the KV slots gives every
    sampled token the scoring function's log-prob up to FP32 rounding (a decode row's CPU attention is not the
    trainer's per-sequence call, so bits may differ; ~1e-7 for 2 layers). A wrong slot, position, mask or head would
    move a log-prob by far more than the 1e-5 allowed. The GPU run is where it is checked bit for bit."""
    env = {**os.environ, "PYTHONPATH": os.path.dirname(BENCH)}
    out = subprocess.run([sys.executable, os.path.join(PROBES, "exact_decode.py"), "--shape", "tiny", "--device", "cpu",
                          "--prompts", "2", "--samples", "2", "--prompt", "5", "--new", "12"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    head, row = [l for l in out.stdout.splitlines() if l.startswith("| ") and ("shape" in l or "tiny" in l)]
    r = dict(zip([c.strip() for c in head.split("|")[1:-1]], [c.strip() for c in row.split("|")[1:-1]]))
    assert r["tokens"] == "48" and float(r["max_abs_diff"]) < 1e-5


def test_cpu_contention_help_and_flags_without_torch():
    out = subprocess.run([sys.executable, "-c", NO_TRL, os.path.join(BENCH, "cpu_contention.py"), "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--quick" in out.stdout and "--cores" in out.stdout, out.stderr
    cc = load("cpu_contention.py")
    a = cc.parse_args(["--quick"])
    assert (a.sft_rows, a.grpo_steps, a.repeats, a.load_list, a.setting_list) == (256, 4, 1, [0, 1], ["old", "new"])
    for bad in (["--loads", "one"], ["--settings", "old,fast"], ["--grpo-steps", "2"], ["--cores", "100000"]):
        with pytest.raises(SystemExit) as e:
            cc.parse_args(bad)
        assert e.value.code == 2
    env = cc.child_env("old", 2)  # torch's defaults on 2 cores, whatever this shell sets
    assert env["POLYRL_CPU_THREADS"] == "2" and env["GOMP_SPINCOUNT"] == "300000" and "OMP_WAIT_POLICY" not in env


@pytest.mark.slow
def test_cpu_contention_runs_the_demo_phases_and_prints_one_table(tmp_path):
    """The new setting on an unloaded run, on one core: two SFT steps and four GRPO steps of the demo, read back from
    their metrics.jsonl into the table."""
    out = subprocess.run([sys.executable, os.path.join(BENCH, "cpu_contention.py"), "--cores", "1", "--settings", "new",
                          "--loads", "0", "--repeats", "1", "--sft-rows", "128", "--grpo-steps", "4",
                          "--out", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    table = [l for l in out.stdout.splitlines() if l.startswith("| ")]
    assert len(table) == 2 and table[1].split("|")[1].strip() == "new" and "1.00x / 1.00x" in table[1]
    rows = json.load(open(tmp_path / "r.json"))
    assert rows["cores"] == 1 and rows["rows"][0]["sft_s"] > 0 and rows["rows"][0]["grpo_step_s"] > 0


def test_long_tail_quick_prints_the_three_modes_side_by_side(tmp_path):
    """--quick on CPU: the tiny model, 4 prompts x 4 at lognormal lengths (median 6, p99 20, cap 24), 3 steps a mode."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "POLYRL_CPU_THREADS": "1"}
    out = subprocess.run([sys.executable, os.path.join(BENCH, "long_tail.py"), "--quick", "--out", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    table = [l for l in out.stdout.splitlines() if l.startswith("| ")]
    assert [l.split("|")[1].strip() for l in table[1:]] == ["sync", "partial", "async_partial"]
    res = json.load(open(tmp_path / "r.json"))
    for m in res["modes"]:
        assert m["step_s"] > 0 and m["rollout_s"] > 0 and m["occ_mean"] > 0 and len(m["occupancy"]) == 10
    sync, partial = res["modes"][0], res["modes"][1]
    assert partial["token_lag_mean"] > 0 and sync["token_lag_mean"] is None  # resumed tokens in partial mode only


def test_the_roofline_takes_the_bandwidth_of_the_device_it_runs_on():
    """The decode roofline's denominator comes from the device's name: an H200 is not measured against an H100's HBM."""
    common = load("common.py")
    assert common.hbm_tbps("NVIDIA H200") == 4.8 and common.hbm_tbps("NVIDIA H100 80GB HBM3") == 3.35
    assert common.hbm_tbps("NVIDIA H100 PCIe") == 2.0 and common.hbm_tbps("NVIDIA A100-SXM4-80GB") == 2.039
    assert common.hbm_tbps("Some Other GPU") is None
    assert load("rollout_throughput.py").parse_args([]).hbm_tbps is None  # resolved from the device at run time


def test_ray_step_parse_args_refuses_what_it_cannot_measure():
    mod = load("ray_step.py")
    a = mod.parse_args(["--quick"])
    assert a.device == "cpu" and a.steps == 2 and a.mode_list == list(mod.MODES)
    for bad in (["--steps", "1"], ["--modes", "plain,nope"]):
        with pytest.raises(SystemExit):
            mod.parse_args(bad)
