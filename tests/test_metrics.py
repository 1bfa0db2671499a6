"""polyrl.metrics: the per-phase device-busy summary of --profile-step (the GPU side of it, from a synthetic trace)."""

from polyrl.metrics import Timer, phase_busy


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
