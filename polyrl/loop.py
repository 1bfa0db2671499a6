"""The synchronous RL loop: generate -> score -> advantages -> train -> sync weights, over the step parts that
polyrl/assemble.py builds (polyrl/step/: cursor, rollout, learner, handoff, book). polyrl/loop_async.py runs the same
parts with generation one or more steps ahead."""

from __future__ import annotations

import contextlib
import time

from polyrl.assemble import assemble
from polyrl.config import Config
from polyrl.metrics import Timer


def train(cfg: Config) -> dict:
    parts = assemble(cfg)
    rollout, learner, handoff, book = parts.rollout, parts.learner, parts.handoff, parts.book
    n, m = cfg.rollout.num_rollout, {}
    t_run = time.perf_counter()
    try:
        start = parts.begin()  # inside: a failed resume still stops what assemble started
        for step in range(start, n):
            timer = Timer()
            with book.profiled(step):
                with timer("rollout"):
                    handoff.to_engine()  # shared devices: the trainer leaves them to the engine
                samples, scored, m = rollout.collect(step, timer)
                with timer("rollout"):
                    handoff.to_trainer()  # and the engine gives them back
                learner.update(samples, scored, step, m, timer)
                with timer("weight_sync"):
                    handoff.sync(step + 1)
            book.finish(step, samples, m, timer)
    except BaseException:
        with contextlib.suppress(Exception):  # the error that stopped the run is the one to report
            parts.close(finished=False)
        raise
    parts.close()
    return {"steps": n - start, "wall_seconds": time.perf_counter() - t_run, "last": m if n > start else {}}
