"""Console progress (rich), RUN_DIR/metrics.jsonl, TensorBoard, Weights & Biases, and PNG plots."""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager

CONSOLE_KEYS = [
    ("reward/mean", "reward", "{:.3f}"), ("reward/accuracy", "acc", "{:.2f}"), ("response_len/mean", "len", "{:.1f}"),
    ("kl", "kl", "{:.4f}"), ("clip_frac", "clip", "{:.3f}"), ("entropy", "ent", "{:.3f}"), ("grad_norm", "gnorm", "{:.3f}"),
    ("train_rollout_logprob_abs_diff", "lp_diff", "{:.1e}"), ("tokens_per_s", "tok/s", "{:.0f}"),
]
TIME_KEYS = ("rollout", "reward", "wait_rollout", "train", "weight_sync", "eval", "other", "step")


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
        t0 = time.perf_counter()
        with record_function(f"phase/{name}"):
            yield
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0


def phase_busy(trace: dict) -> list[tuple[str, float, float]]:
    """(phase, wall s, device-busy s) for each `phase/NAME` range of a chrome trace: the union of the GPU kernels' and
    copies' intervals inside the range. Busy well under wall means the phase waits on the host (Python, launches)."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    gpu = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in ev
                 if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
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


def start_wandb(run_dir: str, *, project: str, group: str | None = None, name: str | None = None, mode: str = "online",
                config: dict | None = None):
    """A W&B run whose files go under RUN_DIR/wandb (offline runs too: `wandb sync RUN_DIR/wandb/offline-run-*`)."""
    try:
        import wandb
    except ImportError as e:
        raise ImportError("--use-wandb needs the wandb package: pip install 'polyrl[wandb]'") from e
    return wandb.init(project=project, group=group, name=name, mode=mode, dir=run_dir, config=config)


class MetricsLogger:
    """Each step's metrics as one row of RUN_DIR/metrics.jsonl; the same keys (and step) go to TensorBoard and W&B.
    Only the logger with ``enabled`` (rank 0) writes anything."""

    def __init__(self, run_dir: str, *, total_steps: int, use_tensorboard: bool = False, quiet: bool = False,
                 enabled: bool = True, title: str = "polyrl", wandb: dict | None = None):
        self.enabled = enabled
        self.quiet = quiet or not enabled
        self.tb = self.wandb = None
        self._progress = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        if use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(os.path.join(run_dir, "tb"))
        if wandb is not None:
            self.wandb = start_wandb(run_dir, **wandb)
        if not self.quiet:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            self.console = Console()
            self._progress = Progress(TextColumn(f"[bold]{title}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                      TimeRemainingColumn(), console=self.console, transient=False)
            self._task = self._progress.add_task("steps", total=total_steps)
            self._progress.start()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if k != "step":
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in row.items() if k != "step"}, step=step)
        if self._progress is not None:
            parts = [f"step {step}"] + [f"{short} {fmt.format(row[k])}" for k, short, fmt in CONSOLE_KEYS if k in row]
            if "eval/accuracy" in row:
                parts.append(f"[bold green]eval_acc {row['eval/accuracy']:.3f}[/]")
            times = " ".join(f"{k[:6]} {row['time/' + k]:.1f}s" for k in TIME_KEYS if "time/" + k in row)
            self._progress.console.print(" | ".join(parts) + (f" | [dim]{times}[/]" if times else ""))
            self._progress.update(self._task, completed=step)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def logger_from_config(cfg, *, total_steps: int, enabled: bool, title: str) -> MetricsLogger:
    """The run's MetricsLogger from the logging section (W&B gets the whole config as its run config)."""
    import dataclasses
    lg = cfg.log
    wandb = None
    if lg.use_wandb and enabled:
        wandb = dict(project=lg.wandb_project, group=lg.wandb_group, name=lg.wandb_run_name, mode=lg.wandb_mode,
                     config=dataclasses.asdict(cfg))
    return MetricsLogger(lg.run_dir, total_steps=total_steps, use_tensorboard=lg.use_tensorboard, quiet=lg.quiet,
                         enabled=enabled, title=title, wandb=wandb)


PLOTS = [("reward/mean", "reward"), ("response_len/mean", "response length"), ("kl", "KL"), ("entropy", "entropy"),
         ("eval/accuracy", "held-out accuracy"), ("loss", "loss")]


def plot_run(run_dir: str, out: str | None = None) -> str:
    """Write RUN_DIR/curves.png from metrics.jsonl (reward, length, KL, entropy, accuracy, loss)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no metrics to plot (is {run_dir} a polyrl run directory?)")
    rows = [json.loads(l) for l in open(path) if l.strip()]
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
    with profile(activities=acts, record_shapes=False) as prof:
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
            rows = phase_busy(json.load(f))
        phases = "".join(f"\n  {n:<12} {w:8.3f} s wall, device busy {b:8.3f} s ({b / max(w, 1e-9):4.0%})" for n, w, b in rows)
        phases = f"\nphases (device busy = GPU kernels and copies running inside the phase):{phases}"
    print(f"\n--profile-step {step}: {wall:.3f} s wall, {busy:.3f} s of {where} time in ops "
          f"({busy / max(wall, 1e-9):.0%} of the wall time); trace: {path}{phases}\n{table}", flush=True)
