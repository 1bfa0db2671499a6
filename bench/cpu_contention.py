"""The demo's SFT and GRPO phases on a CPU, on an idle machine and beside 1 and 2 busy processes (`while True: pass`),
with the old behaviour and polyrl's default, in one run; one table.

  old  torch's defaults on a machine of these cores: a thread per core and libgomp's default wait, a 300,000-spin
       busy wait at each barrier (POLYRL_CPU_THREADS=<cores> GOMP_SPINCOUNT=300000)
  new  what `polyrl` does by itself: a single-process CPU run spins at barriers and its thread count follows the
       machine's load (polyrl.cpu_env, polyrl.cpu_governor)
  passive  a thread per core, every thread waiting passively (OMP_WAIT_POLICY=PASSIVE; the default before)
  one  one thread, waiting passively (POLYRL_CPU_THREADS=1): the other way to keep off a busy core
  spin3k, spin10k, spin30k  a thread per core, libgomp spinning 3,000 / 10,000 / 30,000 turns before it sleeps

Each cell runs `polyrl sft` (polyrl.demo.sft_args, the first --sft-rows demonstrations, one epoch) and `polyrl train`
(polyrl.demo.train_args, --grpo-steps GRPO steps) as the demo does. SFT s is the train time of the SFT steps after the
first (sum of time/train in its metrics.jsonl); GRPO step s the median time/step after the first step. Cells run in
an interleaved order (old, new, then new, old at the next repeat) so that a change in the machine's other load falls
on both settings; "others busy" is how busy the machine's cores were with work other than the measured run (the busy
processes included: 1 busy process on 2 cores reads about 50%). The wait and thread settings of this shell
(OMP_WAIT_POLICY, GOMP_SPINCOUNT, KMP_BLOCKTIME, OMP_NUM_THREADS, POLYRL_CPU_THREADS) are not passed on: each setting
names its own.

  python3 bench/cpu_contention.py                  # 2 repeats of 2 settings x 3 loads (50 min on 2 shared cores)
  python3 bench/cpu_contention.py --cores 2        # on a bigger machine: this process and its children on 2 cores
  python3 bench/cpu_contention.py --quick          # a smoke run: small phases, 1 repeat, loads 0 and 1
  python3 bench/cpu_contention.py --real-model build/smollm2-135m-instruct --loads 0,1 --repeats 1
                                                   # the real-weight example's GRPO step instead of the demo's phases
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
from common import ContentionProbe, fmt, markdown_table, median, write_json  # noqa: E402

CLEARED = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_NUM_THREADS", "POLYRL_CPU_THREADS")
BUSY = "while True: pass"


def settings(cores: int) -> dict[str, dict[str, str]]:
    """Each setting's environment additions (after CLEARED is removed)."""
    return {"old": {"POLYRL_CPU_THREADS": str(cores), "GOMP_SPINCOUNT": "300000"},  # libgomp's own default spin
            "new": {}, "one": {"POLYRL_CPU_THREADS": "1"},
            # the default before the thread count followed the load: every thread waits passively
            "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
            # shorter spins than libgomp's default, before a thread sleeps at a barrier (--settings old,spin10k,...)
            **{f"spin{k}k": {"POLYRL_CPU_THREADS": str(cores), "GOMP_SPINCOUNT": str(k * 1000)} for k in (3, 10, 30)}}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cores", type=int, default=None,
                   help="run on the first N cores this process may use (os.sched_setaffinity; default: all of them)")
    p.add_argument("--loads", default="0,1,2", help="busy processes beside the run, comma-separated (default 0,1,2)")
    p.add_argument("--settings", default="old,new", help="comma-separated, of: old, new, passive, one, spin3k, spin10k, spin30k (default old,new)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each cell, in alternating order (default 2)")
    p.add_argument("--sft-rows", type=int, default=1280, help="SFT demonstrations, one epoch at 64 a step (default 1280)")
    p.add_argument("--grpo-steps", type=int, default=5, help="GRPO steps (the first is not timed; default 5)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one phase may take (default 1800)")
    p.add_argument("--work-dir", default=None, help="keep the runs here (default: a temporary directory, removed)")
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    p.add_argument("--real-model", default=None, metavar="DIR",
                   help="instead of the demo: GRPO steps of examples/real_model/config.yaml's task on this converted "
                        "SmolLM2-135M-Instruct directory (python tests/real_model.py builds build/smollm2-135m-instruct)")
    p.add_argument("--real-steps", type=int, default=3, help="--real-model: GRPO steps, the first not timed (default 3)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 256 SFT rows, 4 GRPO steps, 1 repeat, loads 0 and 1")
    a = p.parse_args(argv)
    if a.quick:
        a.sft_rows, a.grpo_steps, a.repeats, a.loads = 256, 4, 1, "0,1"
    try:
        a.load_list = [int(x) for x in a.loads.split(",") if x.strip()]
    except ValueError:
        p.error(f"--loads {a.loads!r}: give whole numbers of busy processes, comma-separated")
    a.setting_list = [s.strip() for s in a.settings.split(",") if s.strip()]
    if not a.setting_list or any(s not in settings(1) for s in a.setting_list):
        p.error(f"--settings {a.settings!r}: choose from {', '.join(settings(1))}")
    if not a.load_list or min(a.load_list) < 0:
        p.error(f"--loads {a.loads!r}: give 0 or more busy processes")
    if a.sft_rows < 128:
        p.error("--sft-rows must be 128 or more (two SFT steps of 64: the first is not timed)")
    if a.grpo_steps < 4:
        p.error("--grpo-steps must be 4 or more (3 timed after the first)")
    if a.repeats < 1:
        p.error("--repeats must be 1 or more")
    if a.real_model is not None and not os.path.isfile(os.path.join(a.real_model, "config.json")):
        p.error(f"--real-model {a.real_model}: no config.json there (python tests/real_model.py builds one)")
    if a.real_steps < 2:
        p.error("--real-steps must be 2 or more (the first is not timed)")
    if a.cores is not None and not 1 <= a.cores <= len(os.sched_getaffinity(0)):
        p.error(f"--cores {a.cores}: this process may use {len(os.sched_getaffinity(0))} cores")
    return a


def child_env(setting: str, cores: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(settings(cores)[setting])
    return env


def run_phase(what: str, args: list[str], env: dict[str, str], timeout: float, log_path: str) -> None:
    """`python -m polyrl ARGS` into log_path; a failure or a timeout raises RuntimeError naming the phase and its log."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "polyrl", *args], env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
            raise RuntimeError(f"{what} did not finish within --timeout {timeout:g} s (log {log_path})") from None
    if code != 0:
        with open(log_path) as f:
            tail = f.read()[-2000:]
        raise RuntimeError(f"{what} exited {code} (log {log_path}):\n{tail}")


def read_rows(path: str) -> list[dict]:
    import json
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:  # a half-written line
                continue
    return rows


def sft_seconds(run_dir: str) -> float:
    """Train time of the SFT steps after the first (its first call builds the optimizer state)."""
    return sum(r["time/train"] for r in read_rows(os.path.join(run_dir, "metrics.jsonl"))
               if r.get("step", 0) > 1 and "time/train" in r)


def grpo_step_seconds(run_dir: str) -> float:
    steps = [r["time/step"] for r in read_rows(os.path.join(run_dir, "metrics.jsonl"))
             if r.get("step", 0) > 1 and "time/step" in r]
    if not steps:
        raise RuntimeError(f"{run_dir}/metrics.jsonl: no GRPO step after the first")
    return median(steps)


def real_model_args(model: str, data: dict, run_dir: str, steps: int) -> list[str]:
    """examples/real_model/config.yaml's training, without its evals and checkpoints."""
    return ["train", "--device", "cpu", "--hf-checkpoint", model, "--prompt-data", data["train"], "--apply-chat-template",
            "--rm-type", "gsm8k", "--advantage-estimator", "grpo", "--rollout-batch-size", "8", "--n-samples-per-prompt",
            "4", "--rollout-max-response-len", "24", "--rollout-temperature", "1.0", "--num-rollout", str(steps),
            "--lr", "1e-5", "--seed", "1", "--run-dir", run_dir, "--quiet"]


def run_real_cell(work: str, data: dict, setting: str, load: int, rep: int, cores: int, a) -> dict:
    cell = os.path.join(work, f"real_{setting}_load{load}_rep{rep}")
    os.makedirs(cell, exist_ok=True)
    run = os.path.join(cell, "grpo")
    with ContentionProbe() as probe:
        run_phase(f"{setting} real-model GRPO beside {load} busy", real_model_args(a.real_model, data, run, a.real_steps),
                  child_env(setting, cores), a.timeout, os.path.join(cell, "grpo.log"))
    rows = [r for r in read_rows(os.path.join(run, "metrics.jsonl")) if r.get("step", 0) > 1]
    part = {k: median([r[f"time/{k}"] for r in rows]) for k in ("rollout", "train")}
    return {"setting": setting, "load": load, "repeat": rep, "sft_s": None, "grpo_step_s": grpo_step_seconds(run),
            **{f"{k}_s": v for k, v in part.items()}, "others_busy": probe.other_frac, "wall_s": probe.wall}


def run_cell(work: str, paths: dict, base: str, setting: str, load: int, rep: int, cores: int, a) -> dict:
    from polyrl.demo import sft_args, train_args
    cell = os.path.join(work, f"{setting}_load{load}_rep{rep}")
    os.makedirs(cell, exist_ok=True)
    env = child_env(setting, cores)
    sft_dir, sft_run, grpo_run = (os.path.join(cell, x) for x in ("sft_model", "sft", "grpo"))
    with ContentionProbe() as probe:
        run_phase(f"{setting} SFT beside {load} busy", sft_args(base, paths, sft_dir, sft_run, epochs=1, seed=1), env,
                  a.timeout, os.path.join(cell, "sft.log"))
        run_phase(f"{setting} GRPO beside {load} busy",
                  train_args(sft_dir, paths, grpo_run, steps=a.grpo_steps, seed=1, eval_interval=a.grpo_steps + 1),
                  env, a.timeout, os.path.join(cell, "grpo.log"))
    return {"setting": setting, "load": load, "repeat": rep, "sft_s": sft_seconds(sft_run),
            "grpo_step_s": grpo_step_seconds(grpo_run), "others_busy": probe.other_frac, "wall_s": probe.wall}


def table(rows: list[dict], settings_: list[str], loads: list[int]) -> tuple[list[str], list[list]]:
    headers = ["setting", "busy beside", "SFT s", "GRPO step s", "slowdown vs idle (SFT / GRPO)", "others busy", "runs"]
    out = []
    for s in settings_:
        idle = None
        for load in loads:
            rs = [r for r in rows if r["setting"] == s and r["load"] == load]
            if not rs:
                continue
            sfts = [r["sft_s"] for r in rs if r["sft_s"] is not None]
            sft, step = (median(sfts) if sfts else None), median([r["grpo_step_s"] for r in rs])
            if load == 0:
                idle = (sft, step)
            slow = (f"{sft / idle[0]:.2f}x" if sft is not None and idle[0] else "-") + f" / {step / idle[1]:.2f}x" \
                if idle else "-"
            busy = median([r["others_busy"] for r in rs if r["others_busy"] is not None])
            spread = ", ".join(f"{fmt(r['sft_s'], '{:.1f}')}/{r['grpo_step_s']:.2f}" for r in rs)
            out.append([s, load, fmt(sft, "{:.1f}"), fmt(step, "{:.3f}"), slow, fmt(busy * 100, "{:.0f}%"), spread])
    return headers, out


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.cores is not None:  # inherited by every phase and busy process started below
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:a.cores])
    cores = len(os.sched_getaffinity(0))
    from polyrl.tasks.arithmetic import build_model, write_datasets
    work = a.work_dir or tempfile.mkdtemp(prefix="polyrl_cpu_contention_")
    os.makedirs(work, exist_ok=True)
    rows: list[dict] = []
    try:
        if a.real_model:
            sys.path.insert(0, os.path.join(BENCH, "..", "examples", "real_model"))
            from make_data import write as write_real
            paths, base = write_real(os.path.join(work, "real_data")), None
        else:
            paths = write_datasets(os.path.join(work, "data"), seed=1, digits=2, n_train=a.sft_rows)
            base = os.path.join(work, "base_model")
            build_model(base, seed=1)
        print(f"{cores} cores; settings {', '.join(a.setting_list)}; loads {a.loads}; {a.repeats} repeat(s); "
              f"{a.sft_rows // 64} SFT steps, {a.grpo_steps} GRPO steps a cell; runs under {work}", flush=True)
        for load in a.load_list:
            busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(load)]
            try:
                for rep in range(a.repeats):
                    for s in (a.setting_list if rep % 2 == 0 else a.setting_list[::-1]):
                        t0 = time.perf_counter()
                        r = run_real_cell(work, paths, s, load, rep, cores, a) if a.real_model else \
                            run_cell(work, paths, base, s, load, rep, cores, a)
                        rows.append(r)
                        print(f"  {s} beside {load} busy, repeat {rep + 1}: SFT {fmt(r['sft_s'], '{:.1f}')} s, GRPO "
                              f"step {r['grpo_step_s']:.3f} s ({time.perf_counter() - t0:.0f} s)", flush=True)
            finally:
                for b in busy:
                    b.kill()
                    b.wait(30)
    except RuntimeError as e:
        print(f"cpu_contention: error: {e}", file=sys.stderr)
        return 1
    finally:
        if not a.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    headers, out = table(rows, a.setting_list, a.load_list)
    print(markdown_table(headers, out))
    if a.out:
        write_json(a.out, {"cores": cores, "sft_steps": a.sft_rows // 64, "grpo_steps": a.grpo_steps, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
