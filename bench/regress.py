"""Speed regression gate: three figures of the Qwen2.5-0.5B shape (random weights, nothing downloaded) on one GPU,
beside the last recorded ones in bench/regress_baseline.json. Run it before landing an engine or backend change.

  rollout   tokens/s of the embedded GPU engine, 256 prompts x (128 + 512 new tokens), ignore-EOS, temperature 1:
            bench/rollout_throughput.py's engine row (best of 3 after a warm-up call), its other checks cut short
  train     MFU of one FSDP train step over a 32768-token packed micro-batch, compiled layers:
            bench/train_throughput.py (median of 5 steps after 2 warm-up)
  grpo      `polyrl train` step time at 16 prompts x 8 samples x 256 new tokens (default batching): median of
            time/step in RUN_DIR/metrics.jsonl over 6 steps after 2 warm-up, run by bench/compare_trl.py (polyrl only)

Each runs in a subprocess of its own (its GPU memory, process group and compile caches are its own), under a wall
limit. One table follows: metric, today, last recorded, ratio (today / last), verdict. The verdict is "slower" when
today is worse than the last figure by more than that metric's noise band (see METRICS), "faster" when better by
more, else "same". Exit status: 0, or 1 when a metric is slower or a stage failed, 2 on a usage or device error.

The baseline names its device; a run on another device kind is refused (both names are printed): start that kind's
own file with --baseline NEW.json --update. Without --baseline the visible GPU's shipped file is used
(bench/regress_baseline_h200.json on an H200, else bench/regress_baseline.json, an H100's). --update records today's
figures (device, date, command, commit) after a run in which every stage it ran succeeded.

  PYTHONPATH=. python3 bench/regress.py                  # all three: meant to take under 6 minutes on one H100
  PYTHONPATH=. python3 bench/regress.py --only rollout   # an engine change: the rollout figure alone
  PYTHONPATH=. python3 bench/regress.py --update         # then record today's figures as the baseline
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
from common import markdown_table, median, write_json  # noqa: E402

DEFAULT_BASELINE = os.path.join(BENCH, "regress_baseline.json")
# each device kind's own shipped baseline (the default file is the H100's); a kind not named here starts one with
# --baseline NEW.json --update
DEVICE_BASELINES = {"NVIDIA H200": os.path.join(BENCH, "regress_baseline_h200.json")}
GRPO_WARMUP, GRPO_STEPS, GRPO_MIN_MEASURED = 2, 6, 3


class Metric(NamedTuple):
    key: str
    label: str
    setting: str  # what is measured; the baseline's must be the same for the two to be compared
    higher_is_better: bool
    band: float  # relative noise band: a change within it is not called slower or faster
    fmt: str


# Bands: the largest spread recorded in bench/RESULTS.md for the same code on H100s, rounded up, so that
# machine-to-machine noise does not read as a regression while a 10% slowdown still does.
METRICS = {m.key: m for m in [
    # The decode at B = 256 is GPU-bound: the same tree gave 111,151-111,764 and 116,078-118,444 tok/s in two calls
    # on one H100 (RESULTS, 2026-11-25), a 6.5% spread.
    Metric("rollout_tok_s", "rollout tok/s, 256 x (128 + 512)", "256 prompts x (128 + 512) new tokens, ignore-EOS, "
           "temperature 1", True, 0.07, "{:,.0f}"),
    # RESULTS holds no repeated train_throughput.py runs; the nearest figure, the GRPO train phase (38k tokens), moved
    # within +-2% in one H100 run (35.7-37.2% MFU, 2026-11-25), and a 0.34 s step of 32k tokens is GPU-bound.
    Metric("train_mfu", "train MFU, 32768 tokens, compile", "FSDP, 1 GPU, 32768-token packed micro-batch, compile",
           True, 0.05, "{:.1%}"),
    # The 16x8x256 step is host-bound: the same tree gave 0.703 and 0.751 s in one call, and nearby trees 0.698-0.776 s
    # in calls on other H100s (RESULTS, 2026-11-24/25), about 10%.
    Metric("grpo_step_s", "GRPO step s, 16 x 8 x 256", "polyrl train, 16 prompts x 8 samples x 256 new tokens, "
           "default batching", False, 0.10, "{:.3f}"),
]}
STAGE_OF = {"rollout": "rollout_tok_s", "train": "train_mfu", "grpo": "grpo_step_s"}
# Wall limits, model build and compilation included; the worst case (8 minutes) still fits one 10-minute GPU call.
STAGE_TIMEOUT_S = {"rollout": 150, "train": 150, "grpo": 180}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="bench/regress.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default=None,
                   help="the last recorded figures (default: the visible GPU's shipped file: "
                        "bench/regress_baseline_h200.json on an H200, else bench/regress_baseline.json, an H100's)")
    p.add_argument("--update", action="store_true",
                   help="after the run, write today's figures into --baseline (same device kind, or a new file)")
    p.add_argument("--only", default=",".join(STAGE_OF), metavar="STAGES",
                   help="comma list of rollout, train, grpo (default: all three)")
    p.add_argument("--workdir", default=None,
                   help="models, logs and run dirs; kept, and the GRPO stage reuses its model there on the next run "
                        "(default: a temporary dir, removed unless a stage failed)")
    p.add_argument("--out", default=None, help="also write today's figures and the comparison as JSON here")
    p.add_argument("--dry-run", action="store_true", help="print the stage commands and the baseline, run nothing")
    a = p.parse_args(argv)
    a.stages = [s.strip() for s in a.only.split(",") if s.strip()]
    bad = [s for s in a.stages if s not in STAGE_OF]
    if bad or not a.stages:
        p.error(f"--only: unknown {', '.join(bad) or '(empty)'}; choose from {', '.join(STAGE_OF)}")
    return a


# ---- the stages: fixed command lines of the existing scripts, and the figure read from what they write ------------
def stage_command(stage: str, work: str) -> list[str]:
    py = sys.executable
    if stage == "rollout":  # the engine row at 256 x (128 + 512); the big-batch, greedy and HF parts kept tiny
        return [py, os.path.join(BENCH, "rollout_throughput.py"), "--shape", "qwen2.5-0.5b", "--batch", "256",
                "--prompt-len", "128", "--new-tokens", "512", "--repeats", "3", "--big-batch", "256",
                "--big-new-tokens", "8", "--hf-new-tokens", "0", "--no-graph-check", "--greedy-prompts", "1",
                "--greedy-new-tokens", "1", "--model-dir", os.path.join(work, "rollout_model"),
                "--out", os.path.join(work, "rollout.json")]
    if stage == "train":
        return [py, os.path.join(BENCH, "train_throughput.py"), "--model-shape", "qwen2.5-0.5b", "--tokens", "32768",
                "--variants", "compile", "--steps", "5", "--warmup", "2", "--out", os.path.join(work, "train.jsonl")]
    if stage == "grpo":
        return [py, os.path.join(BENCH, "compare_trl.py"), "--device", "cuda", "--model-shape", "qwen2.5-0.5b",
                "--frameworks", "polyrl", "--prompts-per-step", "16", "--samples-per-prompt", "8",
                "--max-new-tokens", "256", "--micro-batch-size", "16", "--polyrl-default-batching",
                "--warmup", str(GRPO_WARMUP), "--steps", str(GRPO_STEPS), "--row-budget", "polyrl=130",
                "--kill-grace", "15", "--deadline", str(STAGE_TIMEOUT_S["grpo"] - 5),
                "--workdir", os.path.join(work, "grpo"), "--out", os.path.join(work, "grpo", "compare.json")]
    raise ValueError(stage)


def read_rollout(work: str) -> tuple[float, str]:
    with open(os.path.join(work, "rollout.json")) as f:
        res = json.load(f)
    eng = res["engine"]
    runs = ", ".join(f"{r['tok_s']:,.0f}" for r in eng["runs"])
    return eng["tok_s"], f"runs {runs} tok/s; {100 * eng['tok_s'] / eng['roofline']['tok_s']:.1f}% of the HBM roofline"


def read_train(work: str) -> tuple[float, str]:
    with open(os.path.join(work, "train.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows or "mfu" not in rows[-1]:
        raise RuntimeError(f"train_throughput.py wrote no MFU: {rows[-1] if rows else 'no row'}")
    r = rows[-1]
    return r["mfu"], f"step {r['step_s']:.4f} s, {r['tokens_per_s']:,} tok/s, peak {r['peak_mem_gib']} GiB"


def grpo_step_from_metrics(path: str, warmup: int = GRPO_WARMUP) -> tuple[float, str]:
    """Median time/step of the steps after `warmup` in a metrics.jsonl (a half-written last line is skipped)."""
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    steps = [r for r in rows if r.get("step", 0) > warmup and "time/step" in r]
    if len(steps) < GRPO_MIN_MEASURED:
        raise RuntimeError(f"{path}: {len(steps)} steps after {warmup} warm-up steps, {GRPO_MIN_MEASURED} needed")
    part = lambda k: median([r.get(f"time/{k}", float("nan")) for r in steps])  # noqa: E731
    return median([r["time/step"] for r in steps]), (
        f"median of {len(steps)} steps; rollout {part('rollout'):.3f} / train {part('train'):.3f} / "
        f"weight sync {part('weight_sync'):.3f} s")


def read_grpo(work: str) -> tuple[float, str]:
    return grpo_step_from_metrics(os.path.join(work, "grpo", "polyrl_run0", "metrics.jsonl"))


READERS = {"rollout": read_rollout, "train": read_train, "grpo": read_grpo}


# ---- comparison -----------------------------------------------------------------------------------------------------
def verdict(m: Metric, today: float, last: float) -> tuple[float, str]:
    """(today / last, verdict): worse by more than the band is "slower", better by more is "faster"."""
    ratio = today / last
    gain = ratio if m.higher_is_better else 1 / ratio  # > 1: better today
    if gain < 1 - m.band:
        return ratio, "slower"
    if gain > 1 + m.band:
        return ratio, "faster"
    return ratio, f"same (within {m.band:.0%})"


def device_mismatch(baseline: dict | None, device: str) -> str | None:
    """Why today's device cannot be compared with the baseline's (None: it can)."""
    if baseline is None or baseline.get("device") == device:
        return None
    return (f"the baseline was recorded on {baseline.get('device')!r} and this GPU is {device!r}: figures of another "
            f"device kind are not comparable; start that kind's own file with --baseline NEW.json --update")


def compare_rows(baseline: dict | None, today: dict[str, float], failed: dict[str, str] | None = None
                 ) -> tuple[list[list[str]], bool]:
    """The table's rows: each metric run today (measured or failed, keyed by metric) and each other one the baseline
    holds; True when any is slower."""
    rows, slower = [], False
    recorded, failed = (baseline or {}).get("metrics", {}), failed or {}
    for key, m in METRICS.items():
        last, now = recorded.get(key), today.get(key)
        if now is None and last is None and key not in failed:
            continue
        last_cell = f"{m.fmt.format(last['value'])} ({last.get('date', '?')})" if last else "-"
        if key in failed:
            rows.append([m.label, "FAILED", last_cell, "-", failed[key]])
        elif now is None:
            rows.append([m.label, "not run", last_cell, "-", "-"])
        elif last is None:
            rows.append([m.label, m.fmt.format(now), "-", "-", "no baseline"])
        elif last.get("setting") != m.setting:
            rows.append([m.label, m.fmt.format(now), last_cell, "-",
                         f"not comparable: recorded at {last.get('setting')!r}"])
        else:
            ratio, v = verdict(m, now, last["value"])
            slower |= v == "slower"
            rows.append([m.label, m.fmt.format(now), last_cell, f"{ratio:.3f}", v])
    return rows, slower


def updated_baseline(baseline: dict | None, device: str, today: dict[str, float], command: str, date: str,
                     commit: str | None) -> dict:
    """The baseline with today's figures in place of the recorded ones (metrics not run today are kept)."""
    if device_mismatch(baseline, device):
        raise ValueError(device_mismatch(baseline, device))
    out = {"device": device, "metrics": dict((baseline or {}).get("metrics", {}))}
    for key, value in today.items():
        out["metrics"][key] = {"value": value, "setting": METRICS[key].setting, "date": date, "command": command,
                               "commit": commit, "source": "measured by bench/regress.py --update"}
    return out


def baseline_path(given: str | None, device: str | None) -> str:
    """--baseline if given, else the shipped file of the device kind (the H100's when the kind has none)."""
    return given or DEVICE_BASELINES.get(device or "", DEFAULT_BASELINE)


def load_baseline(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


# ---- running --------------------------------------------------------------------------------------------------
def _on_terminate(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through run_stage's finally, which kills the stage's process group


def child_env(stage: str, work: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if stage == "train":  # its model goes to a mkdtemp() it never removes: put that under the workdir
        import getpass
        env.setdefault("TORCHINDUCTOR_CACHE_DIR",  # the default cache, which TMPDIR would otherwise move
                       os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))
        env["TMPDIR"] = os.path.join(work, "tmp")
        os.makedirs(env["TMPDIR"], exist_ok=True)
    return env


def shown(cmd: list[str]) -> str:
    """A stage's command as a developer would type it."""
    return shlex.join(["python3", os.path.relpath(cmd[1], REPO), *cmd[2:]] if cmd[1].startswith(BENCH) else cmd)


def run_stage(stage: str, work: str) -> tuple[float | None, str]:
    """Runs one stage under its wall limit; (figure, details) or (None, why it failed)."""
    cmd = stage_command(stage, work)
    log_path = os.path.join(work, f"{stage}.log")
    limit = STAGE_TIMEOUT_S[stage]
    print(f"[{stage}] {shown(cmd)}\n    log {log_path}, limit {limit} s", flush=True)
    t = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=child_env(stage, work),
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if proc.poll() is None:  # timed out, or this script was interrupted: the stage must not keep the GPU
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    wall = time.perf_counter() - t
    why = f"killed at its {limit} s limit" if rc is None else (f"exit {rc}" if rc else None)
    value = details = None
    if why is None:
        try:
            value, details = READERS[stage](work)
        except (OSError, KeyError, ValueError, RuntimeError) as e:
            why = f"no figure: {type(e).__name__}: {e}"
    if why:
        with open(log_path, errors="replace") as f:
            tail = f.read().strip().splitlines()[-20:]
        print(f"[{stage}] FAILED after {wall:.0f} s ({why}); last lines of {log_path}:\n    " + "\n    ".join(tail),
              file=sys.stderr, flush=True)
        return None, why
    print(f"[{stage}] done in {wall:.0f} s: {METRICS[STAGE_OF[stage]].fmt.format(value)} ({details})", flush=True)
    return value, details


def gpu_name() -> str | None:
    """The visible GPU's name as torch reports it, from a child process (this one keeps no CUDA context)."""
    code = "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        print("regress: error: `import torch` and the CUDA device query did not answer within 60 s", file=sys.stderr)
        raise SystemExit(2) from None
    if out.returncode != 0:
        print(f"regress: error: the CUDA device query failed: {out.stderr.strip()[-500:]}", file=sys.stderr)
        raise SystemExit(2)
    return out.stdout.strip() or None


def git_commit() -> str | None:
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=30)
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+uncommitted changes" if dirty.stdout.strip() else "")


def main(argv=None) -> int:
    a = parse_args(argv)
    # What produced the figures: --update, --out, --workdir and --baseline do not change them
    command = "PYTHONPATH=. python3 bench/regress.py" + ("" if a.stages == list(STAGE_OF) else f" --only {','.join(a.stages)}")
    device = None if a.dry_run else gpu_name()  # a dry run queries no GPU (nor imports torch)
    a.baseline = baseline_path(a.baseline, device)
    try:
        baseline = load_baseline(a.baseline)
    except ValueError as e:
        print(f"regress: error: --baseline {a.baseline}: not JSON ({e})", file=sys.stderr)
        return 2
    if a.dry_run:
        work = a.workdir or "<workdir>"
        print(json.dumps({"stages": {s: shown(stage_command(s, work)) for s in a.stages},
                          "limits_s": {s: STAGE_TIMEOUT_S[s] for s in a.stages}, "baseline": baseline}, indent=1))
        return 0
    if device is None:
        print("regress: error: no CUDA GPU is visible; this benchmark runs on one GPU", file=sys.stderr)
        return 2
    why = device_mismatch(baseline, device)
    if why:
        print(f"regress: error: {why}", file=sys.stderr)
        return 2
    print(f"device: {device}; baseline: {a.baseline}" + ("" if baseline else " (none yet)"), flush=True)
    signal.signal(signal.SIGTERM, _on_terminate)
    work = a.workdir or tempfile.mkdtemp(prefix="polyrl_regress_")
    os.makedirs(work, exist_ok=True)
    t0 = time.perf_counter()
    today, details, failed = {}, {}, {}
    for stage in a.stages:
        value, info = run_stage(stage, work)
        if value is None:
            failed[STAGE_OF[stage]] = info
        else:
            today[STAGE_OF[stage]], details[STAGE_OF[stage]] = value, info
    rows, slower = compare_rows(baseline, today, failed)
    print()
    print(markdown_table(["metric", "today", "last recorded", "ratio (today / last)", "verdict"], rows))
    print(f"\n{device}, {time.strftime('%Y-%m-%d')}, {time.perf_counter() - t0:.0f} s; bands: "
          + ", ".join(f"{METRICS[STAGE_OF[s]].label.split(',')[0]} {METRICS[STAGE_OF[s]].band:.0%}" for s in a.stages)
          + " (why: bench/regress.py METRICS); a ratio above 1 is better for tok/s and MFU, worse for step s")
    for key, info in details.items():
        print(f"  {METRICS[key].label}: {info}")
    if slower:
        print("slower: rerun once; if it stays, time the parent commit on the same machine (bench/README.md, "
              "section regress.py) before calling it a regression")
    if a.out:
        write_json(a.out, {"device": device, "date": time.strftime("%Y-%m-%d"), "command": command, "today": today,
                           "details": details, "failed": failed, "baseline": baseline,
                           "table": [dict(zip(["metric", "today", "last", "ratio", "verdict"], r)) for r in rows]})
    if a.update:
        if failed:
            print(f"--update: not written, {', '.join(failed)} failed", file=sys.stderr)
        else:
            new = updated_baseline(baseline, device, today, command, time.strftime("%Y-%m-%d"), git_commit())
            write_json(a.baseline, new)
            print(f"--update: wrote {', '.join(today)} to {a.baseline}")
    if not a.workdir and not failed:
        shutil.rmtree(work, ignore_errors=True)
    elif failed:
        print(f"logs kept in {work}", file=sys.stderr)
    return 1 if (slower or failed) else 0


if __name__ == "__main__":
    sys.exit(main())
