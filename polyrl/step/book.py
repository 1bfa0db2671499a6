"""The book: a step's metrics, the held-out eval, the log line and the checkpoints."""

from __future__ import annotations

import contextlib
import dataclasses
import time

from polyrl import cpu_governor
from polyrl.checkpoint import CheckpointWriter
from polyrl.config import Config
from polyrl.dist import Dist, barrier, restart_count
from polyrl.metrics import PROGRESS, GcWatch, MetricsLogger, Timer, combine_rank_stats, stop_if_signalled
from polyrl.rollout.base import RolloutEngine
from polyrl.step.cursor import PromptCursor
from polyrl.step.rollout import Evaluator, write_records
from polyrl.types import Sample


class StopAtBoundary(Exception):
    """A stop asked for between steps (SIGUSR1, --max-wall-time), raised once the step's checkpoint is complete."""


def boundary_stop(cfg: Config, d: Dist, t_start: float, step_s: float) -> str | None:
    """Why the run stops after this step, the same answer on every rank: SIGUSR1 reached a rank, or another step as
    long as this one would end past --max-wall-time (seconds since start-up); None to go on."""
    limit = cfg.checkpoint.max_wall_time
    late = bool(limit) and time.perf_counter() - t_start + step_s > limit
    signalled, late = d.max([float(PROGRESS.get("stop_request") is not None), float(late)])
    if signalled:
        return "SIGUSR1"
    return f"--max-wall-time {limit:g} s (another step would end past it)" if late else None


class Book:
    def __init__(self, cfg: Config, d: Dist, logger: MetricsLogger, cursor: PromptCursor, engine: RolloutEngine,
                 evaluate: Evaluator | None, save: "Saver | None", device: str):
        """evaluate: the held-out eval (None without --eval-prompt-data and --eval-interval); save(step, loop_state):
        a checkpoint (None without --save)."""
        self.cfg, self.d, self.logger, self.cursor, self.engine = cfg, d, logger, cursor, engine
        self.evaluate, self.save, self.device = evaluate, save, device
        self._t_step = time.perf_counter()  # time/step: wall time between two steps' logs, all phases and overheads included
        self._t_start = self._t_step  # --max-wall-time counts from here (the models are built by now)
        self.restarts = restart_count()  # torchrun's or Ray's --max-restarts: which attempt this is
        self.gc = GcWatch()
        self._retries = self._alloc_retries()  # the allocator's cumulative retry count at the last step's log

    def start(self, step: int) -> None:
        """Before the first step of a run from scratch: the eval curve starts from the initial policy."""
        if self.evaluate is not None and step == 0:
            self.logger.log(0, self._eval(0))
        self._t_step = time.perf_counter()

    def profiled(self, step: int):
        """A context for step `step` (0-based): torch.profiler around it when --profile-step names it."""
        if self.cfg.log.profile_step != step + 1:
            return contextlib.nullcontext()
        from polyrl.metrics import step_profiler
        return step_profiler(self.cfg.log.run_dir, step + 1, self.device, enabled=self.d.is_main)

    def finish(self, step: int, samples: list[Sample], m: dict, timer: Timer, rollout_s: float | None = None) -> None:
        """Step metrics, eval, log, checkpoint; `step` is 0-based, the policy is now at version step + 1.
        rollout_s: the generation time of these samples (default: the timer's rollout phase)."""
        cfg, d = self.cfg, self.d
        if rollout_s is None:
            rollout_s = timer.times.get("rollout", 0.0)
        data_state = self.cursor.checkpoint_state(step + 1)  # where a resume draws the next step's prompts, in which data
        n_resp, n_tok, n_trunc = d.sum([len(samples), sum(len(s.response_ids) for s in samples),
                                        sum(s.finish_reason == "length" for s in samples)])
        m.update(self.engine_stats())
        if self.restarts:
            m["restarts"] = float(self.restarts)
        m.update(self.gpu_memory())
        m.update(cpu_governor.metrics())
        m.update({"response_len/mean": n_tok / max(n_resp, 1), "dropped_prompts": self.cursor.num_dropped,
                  "truncated_frac": n_trunc / max(n_resp, 1), "tokens_per_s": n_tok / max(rollout_s, 1e-9)})
        last = step + 1 == cfg.rollout.num_rollout
        if self.evaluate is not None and ((step + 1) % cfg.log.eval_interval == 0 or last):
            with timer("eval"):
                m.update(self._eval(step + 1))
        ck = cfg.checkpoint
        step_s = time.perf_counter() - self._t_step
        why = boundary_stop(cfg, d, self._t_start, step_s) if not last else None
        saving = last or (ck.save_interval and (step + 1) % ck.save_interval == 0) or why is not None
        if self.save is not None and self.save.writer.pending is not None:
            with timer("save_wait"):  # the previous save's background write (--async-save), sealed at this boundary
                self.save.writer.settle()
        if self.save is not None and saving:  # before the log: its row says what the save took (time/save)
            with timer("save"):  # the run's last checkpoint, and one it stops at, are complete before it ends
                self.save(step + 1, data_state, wait=last or why is not None)
        now = time.perf_counter()
        m.update({f"time/{k}": v for k, v in timer.times.items()})
        m["time/step"], self._t_step = now - self._t_step, now
        m["time/gc"] = self.gc.take()  # inside the phases above: the collector's pauses during this step
        # what no phase accounts for (metrics reduction, logging, Python between phases)
        m["time/other"] = m["time/step"] - sum(timer.times.values())
        self.logger.log(step + 1, m)
        if saving and self.save is not None and d.world > 1:
            # the row of a checkpointed step is written before any rank goes on: a rank dying in the next step must
            # not stop rank 0 between the save and its log line, or a resume from that checkpoint skips the row
            barrier()
        self.gc.freeze()  # after the run's first step: what is alive now lives for the run
        stop_if_signalled()
        if why is not None:
            saved = (f"checkpoint of step {step + 1} in --save {ck.save}; resume with --load {ck.save}" if self.save
                     else "nothing saved (no --save)")
            raise StopAtBoundary(f"stopped after step {step + 1} of {cfg.rollout.num_rollout} on {why}: {saved}")

    def _eval(self, step: int) -> dict[str, float]:
        """The held-out eval's metrics; its samples go to RUN_DIR/eval_samples/step_N.jsonl (rank 0 writes)."""
        m = self.evaluate()
        if self.d.is_main:
            import os
            write_records(os.path.join(self.cfg.log.run_dir, "eval_samples", f"step_{step}.jsonl"), self.evaluate.records)
        return m

    def close(self) -> None:
        self.gc.close()

    def gpu_memory(self) -> dict[str, float]:
        """CUDA: the step's peak memory allocated and reserved by this process's caching allocator (the trainer and a
        colocated engine together; CUDA graphs' private pools count, NCCL's buffers and the CUDA context do not), the
        largest over the ranks, in GiB (verl's perf/max_memory_*), and how many allocations found no free block and
        made the allocator hand its cache back to the driver and retry (a stall: the step is at the device's limit);
        the peaks are reset for the next step."""
        if not self.device.startswith("cuda"):
            return {}
        import torch
        retries = self._alloc_retries()
        peaks = self.d.max([torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30,
                            retries - self._retries])
        self._retries = retries
        torch.cuda.reset_peak_memory_stats()
        return {"memory/peak_allocated_gib": peaks[0], "memory/peak_reserved_gib": peaks[1],
                "memory/alloc_retries": peaks[2]}

    def _alloc_retries(self) -> int:
        if not self.device.startswith("cuda"):
            return 0
        import torch
        return torch.cuda.memory_stats().get("num_alloc_retries", 0)

    def engine_stats(self) -> dict[str, float]:
        """The engines' counters since the last step, over all ranks (each rank's engine counts its own requests)."""
        stats = self.engine.stats()
        if self.d.world == 1:
            return stats
        import torch.distributed as dist
        parts: list = [None] * self.d.world
        dist.all_gather_object(parts, stats, group=self.d.group)  # keys may differ by rank: no tensor sum
        return combine_rank_stats(parts)


class Saver:
    """save(step, data position) for --save: the backend (and critic), the loop state and the config, through a
    CheckpointWriter (writer.pending: a background write to seal at the next step's end)."""

    def __init__(self, cfg: Config, backend, critic=None):
        self.cfg, self.backend = cfg, backend
        self.writer = CheckpointWriter.from_config(cfg, critic)

    def __call__(self, step: int, data_state: dict, wait: bool = False) -> None:
        cfg = self.cfg
        self.writer.save(step, self.backend, {"step": step, "data": data_state, **run_identity(cfg),
                                              "config": dataclasses.asdict(cfg)}, wait=wait)


def checkpoint_saver(cfg: Config, backend, critic=None) -> Saver | None:
    return Saver(cfg, backend, critic) if cfg.checkpoint.save else None


def run_identity(cfg: Config) -> dict:
    """What a checkpoint records of the run that wrote it: the base model (polyrl eval / export-hf --load alone read it)
    and the run dir (a resume logs into that one only), as absolute paths."""
    import os
    return {"base_model": os.path.abspath(cfg.model.hf_checkpoint), "run_dir": os.path.abspath(cfg.log.run_dir)}
