"""Console progress (rich), RUN_DIR/metrics.jsonl, TensorBoard, Weights & Biases, and PNG plots; the checks a step's
metrics must pass (failed rewards, the train/rollout log-prob gate), the start-up banner and the closing line."""

from __future__ import annotations

import bisect
import json
import os
import re
import sys
import time
from contextlib import contextmanager

CONSOLE_KEYS = [
    ("reward/mean", "reward", "{:.3f}"), ("reward/accuracy", "acc", "{:.2f}"), ("reward/errors", "rerr", "{:.0f}"),
    ("reward/timeouts", "rtimeout", "{:.0f}"), ("response_len/mean", "len", "{:.1f}"),
    ("kl", "kl", "{:.4f}"), ("clip_frac", "clip", "{:.3f}"), ("entropy", "ent", "{:.3f}"), ("loss", "loss", "{:.4f}"),
    ("grad_norm", "gnorm", "{:.3f}"),
    ("train_rollout_logprob_abs_diff", "lp_diff", "{:.1e}"), ("tokens_per_s", "tok/s", "{:.0f}"),
]
TIME_KEYS = ("rollout", "reward", "wait_rollout", "train", "weight_sync", "eval", "save", "other", "step")
TIME_LABELS = {"wait_rollout": "wait", "weight_sync": "sync"}  # the console's whole-word names of the longer phases
SHOW_WHEN_NONZERO = ("reward/errors", "reward/timeouts")  # console keys that say nothing when 0

# Where the run is, for the line an interrupt or a failed write prints: the last step whose metrics were logged, the
# phase running now, the signal main's handler received (SIGINT / SIGTERM), if any, and what was being written
# ((path, kind) from `writing`: an OSError from a write names no file), and a stop asked for at the next step boundary
# (stop_request: "SIGUSR1"; polyrl.step.book.boundary_stop reads it).
PROGRESS: dict = {"step": None, "phase": None, "signal": None, "writing": None, "stop_request": None}
_OPEN_LOGGERS: list = []
# code that Python runs where an exception is printed and dropped (garbage-collector callbacks): a signal that arrives
# in it only sets PROGRESS["signal"], and the loops stop at the end of the step (stop_if_signalled)
SIGNAL_DEFERRED: set = set()


def stop_if_signalled() -> None:
    """Raise KeyboardInterrupt if main's handler received a signal: the training loops call this after each step. The
    KeyboardInterrupt the handler raises where the main thread is can be lost on its way (raised inside a library's
    catch-all, or in a finalizer, where Python prints and drops it), and the run must stop all the same."""
    if PROGRESS["signal"]:
        raise KeyboardInterrupt(PROGRESS["signal"])


@contextmanager
def writing(path: str, kind: str = "checkpoint"):
    """What the code inside writes (kind: checkpoint, export or run dir), for the CLI's line when a write fails; left set
    when it raises."""
    before = PROGRESS.get("writing")
    PROGRESS["writing"] = (path, kind)
    yield
    PROGRESS["writing"] = before


def quiet_library_bars() -> None:
    """No progress bars of transformers or huggingface_hub ("Loading weights", "Writing model shards") in polyrl's
    output, in this process and the ones it starts (they read the variable when they import transformers)."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()


def set_phase(name: str | None) -> None:
    """The phase running now: shown beside the live progress bar (a long step says where it is) and named by an
    interrupt's message."""
    PROGRESS["phase"] = name
    for lg in _OPEN_LOGGERS:
        if lg._progress is not None:
            lg._progress.update(lg._task, phase=name.replace("_", " ") if name else "")


# Engine counters (RolloutEngine.stats) over the ranks: the requests each rank sent again add up, the engines up is
# the fewest any rank sees, and every other one (a shared server's loss that each rank sees, rank 0's restarts and
# re-syncs, a *_max, a pass's wall time on ranks that run at once) is the largest of the ranks'.
RANK_SUM_STATS = ("rollout/retries", "rollout/busy_retries")
RANK_MIN_STATS = ("rollout/engines_up",)


def combine_rank_stats(parts: list[dict[str, float]]) -> dict[str, float]:
    """One step's engine counters from every rank's (a counter is missing on a rank where it never counted)."""
    out = {}
    for k in sorted(set().union(*parts)):
        vals = [p[k] for p in parts if k in p]
        out[k] = float(sum(vals) if k in RANK_SUM_STATS else min(vals) if k in RANK_MIN_STATS else max(vals))
    return out


class RunStopped(RuntimeError):
    """A step's metrics show the run must not go on (a gate or --max-consecutive-failed-steps); the CLI prints the
    message as one line and exits 1."""


# Config fields that hold secrets (api_key, its *_api_key / *_api_key_file variants, tokens, passwords); the data
# section's input_key / label_key / ... name row fields and are kept.
SECRET_FIELD = re.compile(r"(^|_)(api_key|secret|password|passwd|token)(_file|_path)?$")
REDACTED = "<redacted>"


def redact_secrets(obj):
    """A copy of a (nested) dict/list with every secret field's value replaced by <redacted> (None stays None)."""
    if isinstance(obj, dict):
        return {k: (REDACTED if v is not None and isinstance(k, str) and SECRET_FIELD.search(k) else redact_secrets(v))
                for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact_secrets(v) for v in obj)
    return obj


def notice(msg: str) -> None:
    """A line the user sees whatever the log level: stderr, from rank 0 only."""
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"polyrl: {msg}", file=sys.stderr, flush=True)


class Timer:
    """Wall time per phase of a step; each phase is also a `phase/NAME` range in a --profile-step trace."""

    def __init__(self):
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        from torch.profiler import record_function

        from polyrl.cpu_governor import tick
        tick()  # a phase starts: the CPU thread count the machine's load allows now
        t0 = time.perf_counter()
        set_phase(name)
        with record_function(f"phase/{name}"):
            yield
        set_phase(None)  # left set when the phase raised: an interrupt's message names it
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0


class GcWatch:
    """The cyclic garbage collector's pauses, and the objects alive after a run's first step frozen out of its scans.
    After the first step the model, its compiled graphs and the engine are alive for the whole run: a full collection
    would walk them all again (an exact 0.5B step once waited 0.48 s on one,
    bench/history/2026-11.md#true-on-policy-exact-decode-2026-11-29), so, as SGLang and vLLM do after their start-up,
    they move to the permanent generation (`gc.freeze()`); close() gives them back to the collector, so that a process
    running several runs (tests, a notebook) frees each run's cycles. A signal that arrives inside the pause callback is
    deferred to the end of the step (SIGNAL_DEFERRED): an exception raised there would be printed and dropped."""

    def __init__(self):
        import gc
        self._gc, self._t0, self.paused, self.frozen = gc, 0.0, 0.0, False
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.paused += time.perf_counter() - self._t0

    SIGNAL_DEFERRED.add(_on_gc.__code__)

    def take(self) -> float:
        """Seconds spent in collections since the last take()."""
        t, self.paused = self.paused, 0.0
        return t

    def freeze(self) -> None:
        """Collect once, then keep what is alive out of later collections (once per run)."""
        if not self.frozen:
            self._gc.collect()
            self._gc.freeze()
            self.frozen = True

    def close(self) -> None:
        if self._on_gc in self._gc.callbacks:
            self._gc.callbacks.remove(self._on_gc)
        if self.frozen:
            self._gc.unfreeze()
            self.frozen = False


_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _device_events(trace: dict) -> list[dict]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e and e.get("cat") in _DEVICE_CATS]


def phase_busy(trace: dict) -> list[tuple[str, float, float]]:
    """(phase, wall s, device-busy s) for each `phase/NAME` range of a chrome trace: the union of the GPU kernels' and
    copies' intervals inside the range. Busy well under wall means the phase waits on the host (Python, launches)."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    gpu = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in _device_events(trace))
    merged: list[list[float]] = []
    for a, b in gpu:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    out = []
    for e in ev:
        name = e.get("name", "")
        if e.get("cat") == "user_annotation" and name.startswith("phase/"):
            lo, hi = float(e["ts"]), float(e["ts"]) + float(e["dur"])
            busy = sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in merged)
            out.append((name[len("phase/"):], (hi - lo) / 1e6, busy / 1e6))
    return sorted(out, key=lambda r: -r[1])


# kernel classes by name, first match wins: what a profile needs to say whether a phase is GEMM-, attention- or
# bandwidth-bound (cuBLAS's Hopper kernels are "nvjet"; polyrl's Triton kernels keep their function names)
KERNEL_CLASSES = (
    ("attention", ("flash", "fmha", "attention", "_paged_decode", "_merge_kernel")),  # before gemm: flash kernels name cutlass types
    ("gemm", ("nvjet", "gemm", "xmma", "cutlass", "cublas", "_fp8_linear", "_fp8_w8a8", "_fp8_grouped", "splitkreduce")),
    ("sampler", ("_chunk_stats", "_pick_kernel", "_filter_pass")),
    ("communication", ("nccl",)),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
)


def kernel_class(name: str, cat: str = "kernel") -> str:
    if cat != "kernel":
        return "copy"
    low = name.lower()
    for cls, keys in KERNEL_CLASSES:
        if any(k in low for k in keys):
            return cls
    return "elementwise/reduce"  # Inductor's fused triton_* kernels, norms, activations, RoPE, casts


def _by_class(events) -> dict[str, tuple[float, int]]:
    """{kernel class: (device s, kernels)} of device events, the most time first."""
    out: dict[str, list] = {}
    for e in events:
        s = out.setdefault(kernel_class(e.get("name", ""), e["cat"]), [0.0, 0])
        s[0] += float(e["dur"]) / 1e6
        s[1] += 1
    return {c: (v[0], v[1]) for c, v in sorted(out.items(), key=lambda kv: -kv[1][0])}


def device_classes(trace: dict) -> dict[str, tuple[float, int]]:
    """{kernel class: (device s, kernels)} over every kernel, copy and memset of a chrome trace (a CUDA-only profile of
    one step has no phase ranges): a step whose device time stays while its wall time grows waited on the host."""
    return _by_class(_device_events(trace))


def phase_kernels(trace: dict) -> dict[str, dict[str, tuple[float, int]]]:
    """{phase: {kernel class: (device s, kernels)}} for each `phase/NAME` range of a chrome trace, a device event
    charged to the phase whose range holds its start (graph replays' kernels included where CUPTI reports them)."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    phases = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"][len("phase/"):]) for e in ev
                    if e.get("cat") == "user_annotation" and e.get("name", "").startswith("phase/"))
    starts = [p[0] for p in phases]
    out: dict[str, list[dict]] = {}
    for e in _device_events(trace):
        t = float(e["ts"])
        i = bisect.bisect_right(starts, t) - 1
        while i >= 0 and phases[i][1] < t:  # past the latest phase's end: an earlier one may still enclose t
            i -= 1
        if i >= 0:
            out.setdefault(phases[i][2], []).append(e)
    return {p: _by_class(events) for p, events in out.items()}


def kernel_table(trace: dict) -> str:
    lines = []
    for phase, classes in phase_kernels(trace).items():
        total = sum(s for s, _ in classes.values()) or 1e-12
        parts = ", ".join(f"{c} {s * 1e3:.1f} ms ({s / total:.0%}, {n} kernels)" for c, (s, n) in classes.items())
        lines.append(f"  {phase:<12} {parts}")
    return ("device time by kernel class:\n" + "\n".join(lines)) if lines else ""


_CODE = ("polyrl/", "megatron/", "transformers/", "bench/", "tests/")


def _short(frame: str) -> str:
    for root in _CODE:
        i = frame.find(root)
        if i >= 0:
            return frame[i:]
    return frame


def idle_gaps(trace: dict, top: int = 12, min_us: float = 20.0) -> list[tuple[str, float, int]]:
    """Where the device waited on the host, from a chrome trace recorded with with_stack: each gap of at least min_us
    between the device's kernels and copies (the first one's wait from the start of the trace included) is charged to
    the Python code that launched the kernel ending it, its three innermost frames in polyrl / megatron /
    transformers. (where, idle s, gaps), the most idle first."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    if not ev:
        return []
    dev = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("args", {}).get("correlation"))
                 for e in ev if e.get("cat") in _DEVICE_CATS)
    launched = {e["args"]["correlation"]: float(e["ts"]) for e in ev
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    py = sorted(((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"], e.get("args", {}).get("Python id"),
                 e.get("args", {}).get("Python parent id")) for e in ev if e.get("cat") == "python_function"),
                key=lambda f: (f[0], -f[1]))  # a frame after those that enclose it, when they start together
    starts = [f[0] for f in py]
    by_id = {f[3]: f for f in py if f[3] is not None}

    def where(t: float) -> str:
        i = bisect.bisect_right(starts, t) - 1
        while i >= 0 and py[i][1] < t:  # the innermost frame running at t started last among those still running
            i -= 1
        frames, f, hops = [], py[i] if i >= 0 else None, 0
        while f is not None and len(frames) < 3 and hops < 200:
            if any(r in f[2] for r in _CODE):
                frames.append(_short(f[2]))
            f, hops = by_id.get(f[4]), hops + 1
        return " < ".join(frames) or "(no Python frame: launched outside the traced code)"

    out: dict[str, list] = {}
    end = min(float(e["ts"]) for e in ev)
    for a, b, corr in dev:
        if a - end >= min_us:
            s = out.setdefault(where(launched.get(corr, a)), [0.0, 0])
            s[0] += (a - end) / 1e6
            s[1] += 1
        end = max(end, b)
    return sorted(((k, v[0], v[1]) for k, v in out.items()), key=lambda r: -r[1])[:top]


def idle_table(trace: dict, top: int = 12) -> str:
    rows = idle_gaps(trace, top)
    if not rows:
        return ""
    lines = [f"  {s * 1e3:8.2f} ms in {n:5d} gaps  {w}" for w, s, n in rows]
    return "device idle, by the code that launched the kernel ending each wait (>= 20 us):\n" + "\n".join(lines)


def start_wandb(run_dir: str, *, project: str, group: str | None = None, name: str | None = None, mode: str = "online",
                config: dict | None = None):
    """A W&B run whose files go under RUN_DIR/wandb (offline runs too: `wandb sync RUN_DIR/wandb/offline-run-*`)."""
    try:
        import wandb
    except ImportError as e:
        raise ImportError("--use-wandb needs the wandb package: pip install 'polyrl[wandb]'") from e
    return wandb.init(project=project, group=group, name=name, mode=mode, dir=run_dir,
                      config=redact_secrets(config) if config is not None else None)


class StepChecks:
    """What each step's metrics must pass, on every rank (the metrics are reduced, so every rank stops at the same step
    and no rank is left waiting in a collective):
    - rewards: a step where every reward call failed (errors + timeouts = samples) or every reward is 0 is warned about
      on the console and counted in reward/all_failed and reward/all_zero; after `max_failed` such steps in a row
      (--max-consecutive-failed-steps, 0 = never) the run stops;
    - the log-prob gate: a training step whose train_rollout_logprob_abs_diff_max exceeds `logprob_threshold`
      (--ci-train-rollout-logprob-abs-diff-threshold) stops the run, and so does one that lacks the metric (fail closed)."""

    def __init__(self, max_failed: int = 0, logprob_threshold: float | None = None):
        self.max_failed, self.logprob_threshold = max_failed, logprob_threshold
        self.failed_in_a_row = 0

    def rewards(self, step: int, m: dict) -> tuple[dict[str, float], str | None]:
        """(reward/all_failed and reward/all_zero of this step, empty without reward metrics; why the run must stop, or
        None). Warns on the console and counts steps in a row."""
        n = m.get("reward/samples")
        if not n:
            return {}, None
        failed = m.get("reward/errors", 0.0) + m.get("reward/timeouts", 0.0)
        all_failed = failed >= n - 1e-9  # counts arrive as float sums over the ranks: compare with a float's slack
        all_zero = m.get("reward/zeros", 0.0) >= n - 1e-9
        out = {"reward/all_failed": float(all_failed), "reward/all_zero": float(all_zero)}
        if not (all_failed or all_zero):
            self.failed_in_a_row = 0
            return out, None
        self.failed_in_a_row += 1
        if all_failed:
            what = (f"every reward call failed ({m.get('reward/errors', 0.0):.0f} errors, {m.get('reward/timeouts', 0.0):.0f} "
                    "timeouts; the first is logged above)")
        else:
            what = "every reward is 0 (does the reward fit the data? --rm-type math needs \\boxed{} answers)"
        stop = self.max_failed and self.failed_in_a_row >= self.max_failed
        tail = (f"--max-consecutive-failed-steps {self.max_failed} reached" if stop else
                f"{self.failed_in_a_row} of --max-consecutive-failed-steps {self.max_failed}" if self.max_failed else
                f"{self.failed_in_a_row} in a row; --max-consecutive-failed-steps N stops the run after N")
        notice(f"WARNING step {step}: {what}: the step learns nothing ({tail})")
        why = (f"step {step}: {what}, {self.failed_in_a_row} steps in a row (--max-consecutive-failed-steps "
               f"{self.max_failed}); the metrics of every step are in metrics.jsonl") if stop else None
        return out, why

    def logprob_gate(self, step: int, m: dict) -> None:
        x = self.logprob_threshold
        if x is None or "loss" not in m:  # rows without a training step (the initial eval) have nothing to compare
            return
        v = m.get("train_rollout_logprob_abs_diff_max")
        if v is None:
            raise RunStopped(f"step {step}: --ci-train-rollout-logprob-abs-diff-threshold {x:g} is set but the step logged "
                             "no train_rollout_logprob_abs_diff_max (the engine returned no rollout log-probs?); failing "
                             "closed")
        if not v <= x:  # NaN fails too
            mean = m.get("train_rollout_logprob_abs_diff")
            i, t = m.get("train_rollout_logprob_abs_diff_max_sample"), m.get("train_rollout_logprob_abs_diff_max_token")
            at = f", sample {i:.0f} of the step's batch, response token {t:.0f}" if i is not None and i >= 0 else ""
            raise RunStopped(f"step {step}{at}: train_rollout_logprob_abs_diff_max {v:.6g} > "
                             f"--ci-train-rollout-logprob-abs-diff-threshold {x:g}"
                             + (f" (mean over the step's tokens {mean:.3g})" if mean is not None else "")
                             + ": the trainer's log-probs of the sampled tokens differ from the engine's; stopping")


class MetricsLogger:
    """Each step's metrics as one row of RUN_DIR/metrics.jsonl; the same keys (and step) go to TensorBoard and W&B.
    Only the logger with ``enabled`` (rank 0) writes anything."""

    def __init__(self, run_dir: str, *, total_steps: int, use_tensorboard: bool = False, quiet: bool = False,
                 enabled: bool = True, title: str = "polyrl", wandb: dict | None = None, overwrite: bool = False,
                 checks: StepChecks | None = None):
        """overwrite: empty RUN_DIR/metrics.jsonl now (--overwrite). Otherwise the first step logged cuts the rows at and
        after it (a resume logs each step once). checks: run on every rank, the disabled ones too."""
        self.enabled = enabled
        self.quiet = quiet or not enabled
        self.tb = self.wandb = None
        self._progress = None
        self.checks = checks or StepChecks()
        self._first = True
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        if overwrite:
            open(self.path, "w").close()
        if use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(os.path.join(run_dir, "tb"))
        if wandb is not None:
            self.wandb = start_wandb(run_dir, **wandb)
        if not self.quiet:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            self.console = Console()
            if not self.console.is_terminal:  # a log file: one line per step, however long, never cut at 80 columns
                self.console = Console(soft_wrap=True, width=1000)
            self._progress = Progress(TextColumn(f"[bold]{title}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                      TextColumn("[dim]{task.fields[phase]}"),
                                      TimeRemainingColumn(), console=self.console, transient=False)
            self._task = self._progress.add_task("steps", total=total_steps, phase="")
            self._progress.start()
        _OPEN_LOGGERS.append(self)

    def _cut_at(self, step: int) -> None:
        """Drop the rows of `step` and later ones (written by the run this one resumes, past its checkpoint)."""
        if not os.path.isfile(self.path):
            return
        with open(self.path) as f:
            lines = [l for l in f if l.strip()]
        keep = [l for l, row in zip(lines, read_rows(lines)) if row is not None and row.get("step", -1) < step]
        if len(keep) < len(lines):
            tmp = f"{self.path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                f.writelines(keep)
            os.replace(tmp, self.path)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Write the step's row, then run the checks (which may raise RunStopped, after the row is written)."""
        flags, stop = self.checks.rewards(step, metrics)
        metrics = {**metrics, **flags}
        PROGRESS["step"] = step
        try:
            if self.enabled:
                self._write(step, metrics)
            if stop:
                raise RunStopped(stop)
            self.checks.logprob_gate(step, metrics)
        except RunStopped:
            self.close()
            raise

    def _write(self, step: int, metrics: dict[str, float]) -> None:
        if self._first:
            self._first = False
            self._cut_at(step)
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        with writing(self.path, kind="run dir"), open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if k != "step":
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in row.items() if k != "step"}, step=step)
        if self._progress is not None:
            parts = [f"step {step}"] + [f"{short} {fmt.format(row[k])}" for k, short, fmt in CONSOLE_KEYS
                                        if k in row and (row[k] or k not in SHOW_WHEN_NONZERO)]
            if "eval/accuracy" in row:
                parts.append(f"[bold green]eval_acc {row['eval/accuracy']:.3f}[/]")
            times = " ".join(f"{TIME_LABELS.get(k, k)} {row['time/' + k]:.1f}s" for k in TIME_KEYS if "time/" + k in row)
            self._progress.console.print(" | ".join(parts) + (f" | [dim]{times}[/]" if times else ""))
            self._progress.update(self._task, completed=step)

    def close(self) -> None:
        if self in _OPEN_LOGGERS:
            _OPEN_LOGGERS.remove(self)
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def stop_consoles() -> None:
    """Stop the live progress views of open loggers (an interrupted run's last line must not be drawn over)."""
    for lg in list(_OPEN_LOGGERS):
        if lg._progress is not None:
            lg._progress.stop()
            lg._progress = None


def logger_from_config(cfg, *, total_steps: int, enabled: bool, title: str) -> MetricsLogger:
    """The run's MetricsLogger from the logging section (W&B gets the whole config, secrets redacted, as its run
    config) with the step checks of --max-consecutive-failed-steps and --ci-train-rollout-logprob-abs-diff-threshold."""
    import dataclasses
    lg = cfg.log
    wandb = None
    if lg.use_wandb and enabled:
        wandb = dict(project=lg.wandb_project, group=lg.wandb_group, name=lg.wandb_run_name, mode=lg.wandb_mode,
                     config=redact_secrets(dataclasses.asdict(cfg)))
    checks = StepChecks(max_failed=cfg.reward.max_consecutive_failed_steps,
                        logprob_threshold=lg.ci_train_rollout_logprob_abs_diff_threshold)
    return MetricsLogger(lg.run_dir, total_steps=total_steps, use_tensorboard=lg.use_tensorboard, quiet=lg.quiet,
                         enabled=enabled, title=title, wandb=wandb, overwrite=lg.overwrite and not cfg.checkpoint.load,
                         checks=checks)


def _engine_summary(cfg) -> str:
    r, e = cfg.rollout, cfg.engines
    if cfg.debug.train_only:
        return "none (--debug-train-only: rollouts from files)"
    if e.rollout_external:
        return f"external servers {', '.join(e.rollout_external_engine_addrs)}"
    if r.rollout_engine == "embedded":
        return "embedded (in the trainer's process)"
    return f"{r.rollout_engine} servers x {e.rollout_num_engines or 'auto'} (launched)"


def banner(cfg, placement_summary: str = "") -> str:
    """The start-up line: model, backend, engine, placement, run dir. Printed on rank 0 (stderr) and returned."""
    parts = [f"model {cfg.model.hf_checkpoint}", f"backend {cfg.cluster.train_backend}", f"engine {_engine_summary(cfg)}"]
    if placement_summary:
        parts.append(f"placement {placement_summary}")
    parts.append(f"run dir {os.path.abspath(cfg.log.run_dir)}")
    line = " | ".join(parts)
    notice(line)
    return line


def closing_line(cfg) -> str:
    """Where the run's outputs went: metrics, the latest complete checkpoint, the HF export. Printed on rank 0."""
    from polyrl.checkpoint import critic_hf_dir, latest_complete
    run_dir = os.path.abspath(cfg.log.run_dir)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    parts = [f"metrics {metrics} (curves: polyrl plot {run_dir})" if os.path.isfile(metrics) else
             "no metrics (no step was logged)"]
    ck = cfg.checkpoint
    if ck.save:
        latest = latest_complete(ck.save)
        parts.append(f"checkpoint {latest} (resume: --load {os.path.abspath(ck.save)})" if latest
                     else f"no complete checkpoint in {os.path.abspath(ck.save)}")
    if ck.save_hf:
        out = os.path.abspath(ck.save_hf)
        if cfg.algorithm.advantage_estimator == "gae" and os.path.isdir(critic_hf_dir(out)):
            out += f" (critic: {critic_hf_dir(out)})"
        parts.append(f"HF export {out}")
    line = "done: " + " | ".join(parts)
    notice(line)
    return line


PLOTS = [("reward/mean", "reward"), ("response_len/mean", "response length"), ("kl", "KL"), ("entropy", "entropy"),
         ("eval/accuracy", "held-out accuracy"), ("loss", "loss")]


def read_rows(lines) -> list[dict | None]:
    """metrics.jsonl lines as dicts; None for a line a killed run left half-written (it is never its last word)."""
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            out.append(None)
    return out


def plot_run(run_dir: str, out: str | None = None) -> str:
    """Write RUN_DIR/curves.png from metrics.jsonl (reward, length, KL, entropy, accuracy, loss)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no metrics to plot (is {run_dir} a polyrl run directory?)")
    rows = [r for r in read_rows(l for l in open(path) if l.strip()) if r is not None]
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for ax, (key, title) in zip(axes.flat, PLOTS):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts), marker="o" if len(pts) < 30 else None, ms=3)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = out or os.path.join(run_dir, "curves.png")
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


@contextmanager
def step_profiler(run_dir: str, step: int, device, enabled: bool = True):
    """torch.profiler around one RL step: prints the ops that took the most device (CUDA) or host time and writes
    RUN_DIR/profile_step{step}.json (open in chrome://tracing or Perfetto). Only rank 0 reports."""
    if not enabled:
        yield
        return
    import torch
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.device(device).type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=acts, record_shapes=False, with_stack=cuda) as prof:
        yield
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    path = os.path.join(run_dir, f"profile_step{step}.json")
    os.makedirs(run_dir, exist_ok=True)
    prof.export_chrome_trace(path)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60)
    busy = sum(getattr(e, key) for e in prof.key_averages()) / 1e6
    where = "device" if cuda else "host"
    phases = ""
    if cuda:
        with open(path) as f:
            trace = json.load(f)
        rows = phase_busy(trace)
        phases = "".join(f"\n  {n:<12} {w:8.3f} s wall, device busy {b:8.3f} s ({b / max(w, 1e-9):4.0%})" for n, w, b in rows)
        phases = (f"\nphases (device busy = GPU kernels and copies running inside the phase):{phases}\n{kernel_table(trace)}"
                  f"\n{idle_table(trace)}")
    print(f"\n--profile-step {step}: {wall:.3f} s wall, {busy:.3f} s of {where} time in ops "
          f"({busy / max(wall, 1e-9):.0%} of the wall time); trace: {path}{phases}\n{table}", flush=True)
