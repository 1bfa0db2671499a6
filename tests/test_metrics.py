"""polyrl.metrics: the per-phase device-busy summary of --profile-step (from a synthetic trace), metrics.jsonl on resume and
--overwrite, the step checks (failed rewards, the log-prob gate), the banner and the closing line."""

import os

from polyrl.metrics import (GcWatch, Timer, device_classes, idle_gaps, idle_table, kernel_class, kernel_table, phase_busy,
                            phase_kernels)


def test_phase_busy_is_the_union_of_kernels_inside_each_phase():
    ev = [
        {"ph": "X", "cat": "user_annotation", "name": "phase/rollout", "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "user_annotation", "name": "phase/train", "ts": 1000, "dur": 3000},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1000, "dur": 2000},  # host op: not device time
        # rollout: two overlapping kernels (streams) = one busy interval 100..600, plus a copy 800..900
        {"ph": "X", "cat": "kernel", "name": "k1", "ts": 100, "dur": 400},
        {"ph": "X", "cat": "kernel", "name": "k2", "ts": 300, "dur": 300},
        {"ph": "X", "cat": "gpu_memcpy", "name": "c", "ts": 800, "dur": 100},
        # a kernel across the phase boundary counts on both sides; train also has 2000..2500
        {"ph": "X", "cat": "kernel", "name": "k3", "ts": 950, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "k4", "ts": 2000, "dur": 500},
    ]
    rows = {n: (w, b) for n, w, b in phase_busy({"traceEvents": ev})}
    assert rows["rollout"] == (1e-3, (500 + 100 + 50) / 1e6)
    assert rows["train"] == (3e-3, (50 + 500) / 1e6)
    assert phase_busy({}) == []


def test_kernel_classes_sum_each_phases_device_time_by_what_the_kernels_do():
    ev = [
        {"ph": "X", "cat": "user_annotation", "name": "phase/rollout", "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "user_annotation", "name": "phase/train", "ts": 1000, "dur": 3000},
        {"ph": "X", "cat": "kernel", "name": "nvjet_hsh_128x256_64x4_1x2_h_bz_coopB_NNT", "ts": 10, "dur": 40},
        {"ph": "X", "cat": "kernel", "name": "_paged_decode_kernel", "ts": 60, "dur": 20},
        {"ph": "X", "cat": "kernel", "name": "_add_rmsnorm_kernel", "ts": 90, "dur": 2},
        {"ph": "X", "cat": "kernel", "name": "_rope_store_kernel", "ts": 95, "dur": 3},
        {"ph": "X", "cat": "kernel", "name": "_pick_kernel", "ts": 100, "dur": 4},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 200, "dur": 7},
        {"ph": "X", "cat": "user_annotation", "name": "phase/reward", "ts": 300, "dur": 100},  # inside the rollout
        {"ph": "X", "cat": "kernel", "name": "_silu_mul_kernel", "ts": 500, "dur": 1},  # after it: the rollout's
        {"ph": "X", "cat": "kernel", "name": "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "ts": 1100, "dur": 30},
        {"ph": "X", "cat": "kernel", "name": "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<cutlass::bfloat16_t>>",
         "ts": 1200,
         "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "void at::native::(anonymous namespace)::multi_tensor_apply_kernel", "ts": 3000,
         "dur": 50},
        {"ph": "X", "cat": "kernel", "name": "outside any phase", "ts": 5000, "dur": 50},
    ]
    got = {p: {c: (round(s * 1e6, 6), n) for c, (s, n) in d.items()} for p, d in phase_kernels({"traceEvents": ev}).items()}
    assert got["rollout"] == {"gemm": (40, 1), "attention": (20, 1), "copy": (7, 1), "elementwise/reduce": (6, 3), "sampler": (4, 1)}
    assert got["train"] == {"attention": (100, 1), "optimizer": (50, 1), "elementwise/reduce": (30, 1)}
    assert list(got["rollout"]) == ["gemm", "attention", "copy", "elementwise/reduce", "sampler"]  # the most time first
    assert "reward" not in got
    assert "gemm 0.0 ms (52%, 1 kernels)" in kernel_table({"traceEvents": ev})
    assert kernel_class("ncclDevKernel_AllGather_RING_LL") == "communication" and kernel_table({}) == ""
    # a whole trace (a CUDA-only profile of one step: no phase ranges): every device event, phases or not
    whole = {c: (round(s * 1e6, 6), n) for c, (s, n) in device_classes({"traceEvents": ev}).items()}
    assert whole == {"attention": (120, 2), "elementwise/reduce": (86, 5), "optimizer": (50, 1), "gemm": (40, 1),
                     "copy": (7, 1), "sampler": (4, 1)}
    assert device_classes({}) == {}


def test_idle_gaps_charge_each_device_wait_to_the_code_that_ended_it():
    """A synthetic trace: the device waits 0..100 us before its first kernel (launched from step > plan), 300..1000 us
    between kernels (the next launch from step > optimizer, after a host sync) and 10 us once (under the 20 us floor)."""
    def py(pid, parent, name, ts, dur):
        return {"ph": "X", "cat": "python_function", "name": name, "ts": ts, "dur": dur,
                "args": {"Python id": pid, "Python parent id": parent}}
    ev = [
        py(1, None, "/x/site-packages/torch/autograd.py(1): run", 0, 2000),  # not polyrl code: skipped in the name
        py(2, 1, "/repo/polyrl/step/learner.py(10): step", 0, 2000),
        py(3, 2, "/repo/polyrl/backends/fsdp/backend.py(20): plan", 0, 150),
        py(4, 2, "/repo/polyrl/backends/fsdp/backend.py(30): optimizer", 900, 200),
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 90, "dur": 5, "args": {"correlation": 7}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 950, "dur": 5, "args": {"correlation": 8}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 960, "dur": 5, "args": {"correlation": 9}},
        {"ph": "X", "cat": "kernel", "name": "k1", "ts": 100, "dur": 200, "args": {"correlation": 7}},
        {"ph": "X", "cat": "kernel", "name": "k2", "ts": 1000, "dur": 50, "args": {"correlation": 8}},
        {"ph": "X", "cat": "kernel", "name": "k3", "ts": 1060, "dur": 50, "args": {"correlation": 9}},
    ]
    rows = idle_gaps({"traceEvents": ev})
    assert [(w, round(s * 1e6), n) for w, s, n in rows] == [
        ("polyrl/backends/fsdp/backend.py(30): optimizer < polyrl/step/learner.py(10): step", 700, 1),
        ("polyrl/backends/fsdp/backend.py(20): plan < polyrl/step/learner.py(10): step", 100, 1)]
    assert "700" not in idle_table({"traceEvents": ev}) and "0.70 ms in     1 gaps" in idle_table({"traceEvents": ev})
    assert idle_gaps({}) == [] and idle_table({}) == ""


def test_timer_sums_repeated_phases(monkeypatch):
    import types

    import polyrl.metrics
    clock = iter([10.0, 11.0, 20.0, 22.0, 30.0, 33.0, 40.0, 40.5])  # (start, end) of each phase: 1 s, 2 s, 3 s, 0.5 s
    monkeypatch.setattr(polyrl.metrics, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    t = Timer()
    for _ in range(3):
        with t("train"):
            pass
    with t("rollout"):
        pass
    assert t.times == {"train": 6.0, "rollout": 0.5}  # the three train phases add up; the time between them does not


def test_gc_watch_counts_collections_freezes_once_and_gives_the_objects_back_on_close():
    import gc
    base = gc.get_freeze_count()
    w = GcWatch()
    try:
        w.take()
        gc.collect()  # a collection while watched: its pause is counted
        assert w.take() > 0 and w.take() == 0.0
        w.freeze()
        frozen = gc.get_freeze_count()
        assert frozen > base and w.frozen
        w.freeze()  # once per run: a later step does not collect again
        assert gc.get_freeze_count() == frozen
        w.take()
    finally:
        w.close()
    assert gc.get_freeze_count() == 0 and w._on_gc not in gc.callbacks  # a later run's cycles are collectable again
    gc.collect()
    assert w.take() == 0.0  # no longer watching


# ---- metrics.jsonl: a resume logs each step once, --overwrite starts afresh ----

def _logged(tmp_path):
    import json
    return [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")]


def test_first_logged_step_cuts_the_rows_at_and_after_it(tmp_path):
    from polyrl.metrics import MetricsLogger
    lg = MetricsLogger(str(tmp_path), total_steps=4, quiet=True)
    for s in (0, 1, 2, 3, 4):
        lg.log(s, {"loss": float(s)})
    lg.close()
    lg = MetricsLogger(str(tmp_path), total_steps=4, quiet=True)  # resumed from the checkpoint of step 2
    lg.log(3, {"loss": 30.0})
    lg.log(4, {"loss": 40.0})
    lg.close()
    assert _logged(tmp_path) == [0, 1, 2, 3, 4]
    lg = MetricsLogger(str(tmp_path), total_steps=1, quiet=True, overwrite=True)
    assert _logged(tmp_path) == []
    lg.log(1, {"loss": 1.0})
    assert _logged(tmp_path) == [1]


# ---- step checks ----

def _reward_row(samples=4.0, errors=0.0, timeouts=0.0, zeros=0.0):
    return {"reward/samples": samples, "reward/errors": errors, "reward/timeouts": timeouts, "reward/zeros": zeros}


def test_reward_checks_count_failed_steps_in_a_row_and_reset(capsys):
    from polyrl.metrics import StepChecks
    c = StepChecks(max_failed=2)
    assert c.rewards(1, {"loss": 1.0}) == ({}, None)  # no reward metrics (sft): nothing to check
    assert c.rewards(1, _reward_row(errors=2, timeouts=2, zeros=4)) == ({"reward/all_failed": 1.0, "reward/all_zero": 1.0}, None)
    assert c.rewards(2, _reward_row(zeros=3)) == ({"reward/all_failed": 0.0, "reward/all_zero": 0.0}, None)  # resets
    assert c.rewards(3, _reward_row(zeros=4))[1] is None
    flags, why = c.rewards(4, _reward_row(zeros=4))
    assert flags == {"reward/all_failed": 0.0, "reward/all_zero": 1.0} and why.startswith("step 4: every reward is 0")
    err = capsys.readouterr().err
    assert "WARNING step 1: every reward call failed (2 errors, 2 timeouts" in err and "WARNING step 2" not in err
    # counts averaged over two ranks (loop: sum / world) are still compared as equal
    assert StepChecks().rewards(1, _reward_row(samples=1.5, errors=1.5))[0]["reward/all_failed"] == 1.0


def test_logprob_gate_fails_closed(tmp_path):
    import pytest

    from polyrl.metrics import MetricsLogger, RunStopped, StepChecks
    gate = StepChecks(logprob_threshold=0.1)
    gate.logprob_gate(0, {"eval/accuracy": 0.5})  # an eval-only row: no training step to compare
    gate.logprob_gate(1, {"loss": 1.0, "train_rollout_logprob_abs_diff_max": 0.1})
    for m, words in (({"loss": 1.0}, "no train_rollout_logprob_abs_diff_max"),
                     ({"loss": 1.0, "train_rollout_logprob_abs_diff_max": float("nan")}, "nan > "),
                     ({"loss": 1.0, "train_rollout_logprob_abs_diff_max": 0.25}, "0.25 > ")):
        with pytest.raises(RunStopped, match=words):
            gate.logprob_gate(7, m)
    # the logger writes the step's row first, then stops; a disabled (non-zero rank) logger stops at the same step
    for enabled in (True, False):
        lg = MetricsLogger(str(tmp_path / str(enabled)), total_steps=3, quiet=True, enabled=enabled, checks=StepChecks(logprob_threshold=0.1))
        with pytest.raises(RunStopped, match="step 2: "):
            lg.log(2, {"loss": 1.0, "train_rollout_logprob_abs_diff_max": 0.5})
    assert _logged(tmp_path / "True") == [2] and not (tmp_path / "False").exists()


# ---- banner and closing line ----

def test_banner_and_closing_line_say_where_things_are(tmp_path, capsys):
    from polyrl.checkpoint import save_checkpoint
    from polyrl.config import Config
    from polyrl.metrics import banner, closing_line

    class Backend:
        def save(self, path, *, optimizer=True):
            os.makedirs(os.path.join(path, "dcp"))

    cfg = Config()
    cfg.model.hf_checkpoint, cfg.log.run_dir = "/models/tiny", str(tmp_path / "run")
    line = banner(cfg, "1 rank, engine colocated")
    assert line == (f"model /models/tiny | backend fsdp | engine embedded (in the trainer's process) | placement 1 rank, "
                    f"engine colocated | run dir {tmp_path / 'run'}")
    cfg.checkpoint.save, cfg.checkpoint.save_hf = str(tmp_path / "ck"), str(tmp_path / "hf")
    assert f"no complete checkpoint in {tmp_path / 'ck'}" in closing_line(cfg)
    save_checkpoint(cfg.checkpoint.save, 3, Backend(), {"step": 3})
    assert closing_line(cfg).startswith("done: no metrics (no step was logged) | ")  # no metrics.jsonl is named unwritten
    os.makedirs(tmp_path / "run")
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 3}\n')
    line = closing_line(cfg)
    assert line == (f"done: metrics {tmp_path / 'run' / 'metrics.jsonl'} (curves: polyrl plot {tmp_path / 'run'}) | checkpoint "
                    f"{tmp_path / 'ck' / 'step_000003'} (resume: --load {tmp_path / 'ck'}) | HF export {tmp_path / 'hf'}")
    assert line in capsys.readouterr().err


def test_a_half_written_row_of_a_killed_run_is_dropped_on_resume_and_skipped_by_plot(tmp_path):
    from polyrl.metrics import MetricsLogger, plot_run
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 2.0}\n{"step": 3, "lo')  # killed mid-write
    plot_run(str(tmp_path))
    lg = MetricsLogger(str(tmp_path), total_steps=3, quiet=True)  # resumed from the checkpoint of step 2
    lg.log(3, {"loss": 3.0})
    assert _logged(tmp_path) == [1, 2, 3]
