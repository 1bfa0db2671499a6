"""The rollout part: generate a step's samples and score them. Dynamic sampling (DAPO) is a free function over the
same draw / generate / score / keep (polyrl/rollout/dynamic_sampling.py); --debug-train-only substitutes a rollout
that reads saved samples (FileRollout); --save-debug-rollout-data gives the engine rollout a saver."""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

from polyrl.algorithms.shaping import overlong_penalty
from polyrl.config import Config
from polyrl.data import PromptDataset
from polyrl.debug_rollout import RolloutFiles
from polyrl.dist import Dist
from polyrl.metrics import Timer
from polyrl.rewards import RewardManager, reward_metrics
from polyrl.rollout.base import RolloutEngine
from polyrl.rollout.custom import generate_with, resolve_generate_fn
from polyrl.rollout.dynamic_sampling import GroupFilter, fill_step
from polyrl.rollout.lengths import parse_length_distribution, with_stop_lengths
from polyrl.rollout.sampling import cut_to_budget
from polyrl.step.cursor import PromptCursor
from polyrl.types import Sample, SamplingParams


def sampling_params(cfg: Config, *, seed: int, eval_mode: bool = False) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(
        temperature=r.eval_temperature if eval_mode else r.rollout_temperature,
        top_p=1.0 if eval_mode else r.rollout_top_p, top_k=-1 if eval_mode else r.rollout_top_k,
        max_new_tokens=r.rollout_max_response_len, stop=list(r.rollout_stop), stop_token_ids=list(r.rollout_stop_token_ids),
        n=1 if eval_mode else r.n_samples_per_prompt, seed=seed,
        return_routed_experts=not eval_mode and (cfg.model.return_routed_experts or cfg.model.use_rollout_routing_replay))


def engine_call(engine: RolloutEngine, items: list, params: SamplingParams, max_context_len: int | None = None) -> list[Sample]:
    """One engine call for every prompt of `items`; samples past --rollout-max-context-len are cut to it (engines
    take one max_new_tokens for the whole call, so a long prompt's sample may have generated past its budget)."""
    version = engine.version  # in-process engines: no update can land during their generate
    images = [rec.images for _, rec in items]  # image prompts (--multimodal-keys): the engine makes the pixel inputs
    samples = engine.generate([ids for ids, _ in items], params,
                              **({"images": images} if any(x is not None for x in images) else {}))
    for s in samples:
        if cut_to_budget(s, params.max_new_tokens, max_context_len):
            s.response = engine.tokenizer.decode(s.response_ids, skip_special_tokens=True)
        if s.weight_version is None:  # engine servers report the version each response was generated with
            s.weight_version = version
        rec = items[s.group_index][1]
        s.prompt, s.label, s.metadata = rec.prompt if isinstance(rec.prompt, str) else str(rec.prompt), rec.label, rec.metadata
    return samples


def generate_items(cfg: Config, engine: RolloutEngine, items: list, params: SamplingParams) -> list[Sample]:
    """The rollout of `items`, as training and evaluation both run it: through the --custom-generate-function-path
    when one is set (multi-turn / tools), else one engine call; held to --max-turns and --rollout-max-context-len."""
    r = cfg.rollout
    if r.custom_generate_function_path:
        return generate_with(resolve_generate_fn(r.custom_generate_function_path), r.custom_generate_function_path, engine,
                             engine.tokenizer, items, params, timeout=cfg.engines.rollout_request_timeout,
                             concurrency=r.custom_generate_concurrency, max_turns=r.max_turns,
                             max_context_len=r.rollout_max_context_len)
    if r.rollout_length_distribution and params.stop_lengths is None:
        params = with_stop_lengths(params, parse_length_distribution(r.rollout_length_distribution), len(items))
    return engine_call(engine, items, params, r.rollout_max_context_len)


class Scorer:
    """Sets every sample's reward (with DAPO's overlong penalty when --overlong-buffer-len is set) and returns this
    rank's reward metrics (reward/mean and reward/accuracy are the reward function's, before the penalty). Without a
    reward function (--debug-train-only with no reward flag) the samples keep the rewards saved with them."""

    def __init__(self, cfg: Config, rewards: RewardManager | None):
        self.rewards, self.rw, self.max_len = rewards, cfg.reward, cfg.rollout.rollout_max_response_len

    def __call__(self, samples: list[Sample]) -> dict[str, float]:
        if self.rewards is None:
            return reward_metrics(samples)
        m, rw = self.rewards.score(samples), self.rw
        if rw.overlong_buffer_len:
            pen = overlong_penalty(torch.tensor([len(s.response_ids) for s in samples]), buffer_len=rw.overlong_buffer_len,
                                   max_len=self.max_len, factor=rw.overlong_penalty_factor)
            for s, p in zip(samples, pen.tolist()):
                s.reward += p
            m["reward/overlong_penalty"] = pen.sum().item() / max(len(samples), 1)
        return m

    def close(self) -> None:
        if self.rewards is not None:
            self.rewards.close()


class EngineRollout:
    """Generates each step's samples on the engine and scores them. Returns this rank's reward metrics unreduced: the
    async loop collects on a thread of its own, and collectives on the default group run on the trainer's thread.
    `agents`: an --agent-function-path runner (polyrl.rollout.agent.AgentRunner) generates instead, and its counters
    join the step's metrics."""

    def __init__(self, cfg: Config, engine: RolloutEngine, cursor: PromptCursor, score: Scorer, d: Dist,
                 engine_lock: ContextManager, group_filter: GroupFilter | None = None, saver: RolloutFiles | None = None,
                 agents=None):
        self.cfg, self.engine, self.cursor, self.score, self.d = cfg, engine, cursor, score, d
        self.engine_lock, self.group_filter, self.saver, self.agents = engine_lock, group_filter, saver, agents

    def generate(self, items: list, step: int, draw: int = 0) -> list[Sample]:
        r, d = self.cfg.rollout, self.d
        seed = r.rollout_seed + step * d.world + d.rank + draw * r.num_rollout * d.world  # distinct for every (draw, step, rank)
        params = sampling_params(self.cfg, seed=seed)
        with self.engine_lock:  # with a --custom-generate-function-path, the user's function drives the engine
            if self.agents is not None:
                return self.agents.generate(items, params)
            return generate_items(self.cfg, self.engine, items, params)

    def collect(self, step: int, timer: Timer) -> tuple[list[Sample], dict, dict]:
        """(samples, this rank's reward metrics, step metrics) of `step`, with `timer`'s rollout and reward phases."""
        m: dict = {}
        if self.group_filter is None:
            with timer("rollout"):
                samples = self.generate(self.cursor.draw(step), step)
            with timer("reward"):
                scored = self.score(samples)
        else:  # draws, generates and scores until the step is full: all of it rollout time
            with timer("rollout"):
                samples, scored, m = fill_step(self.cfg.rollout, step, draw=lambda: self.cursor.draw(step),
                                               generate=lambda items, k: self.generate(items, step, k), score=self.score,
                                               keep=self.group_filter)
        if self.saver is not None:
            self.saver.save(step, samples)
        if self.agents is not None:
            m.update(self.agents.pop_metrics())
        return samples, scored, m


class FileRollout:
    """--debug-train-only: each step's samples as a run with --save-debug-rollout-data scored them (rescored when a
    reward flag is given). The prompts are still drawn, so the data position matches the run that saved them."""

    def __init__(self, files: RolloutFiles, cursor: PromptCursor, score: Scorer):
        self.files, self.cursor, self.score = files, cursor, score

    def collect(self, step: int, timer: Timer) -> tuple[list[Sample], dict, dict]:
        with timer("rollout"):
            self.cursor.draw(step)
            samples = self.files.load(step)
        with timer("reward"):
            scored = self.score(samples)
        return samples, scored, {}


class Evaluator:
    """Greedy (or --eval-temperature) accuracy on every prompt of a held-out set, generated the way training generates
    (a custom generate function included: tool use is measured as it is trained)."""

    def __init__(self, cfg: Config, engine: RolloutEngine, dataset: PromptDataset, score: Scorer, d: Dist,
                 engine_lock: ContextManager | None = None, agents=None, progress_s: float = 0.0):
        """progress_s: a line every that many seconds while generating, and one when done (0: silent, as inside
        `polyrl train`, whose progress bar names the eval phase)."""
        self.cfg, self.engine, self.dataset, self.score, self.d = cfg, engine, dataset, score, d
        self.engine_lock, self.agents, self.progress_s = engine_lock or contextlib.nullcontext(), agents, progress_s
        self.records: list[dict] = []  # the last eval's samples, every rank's (eval_records), on every rank

    def __call__(self) -> dict[str, float]:
        cfg, d = self.cfg, self.d
        items = [self.dataset[i] for i in range(len(self.dataset))]
        per = -(-len(items) // d.world)
        mine = items[d.rank * per:(d.rank + 1) * per]
        params = sampling_params(cfg, seed=cfg.rollout.rollout_seed, eval_mode=True)
        with self.engine_lock, heartbeat(f"eval: generating {len(items)} prompts", self.progress_s) as done:
            gen = self.agents.evaluate if self.agents is not None else lambda *a: generate_items(cfg, self.engine, *a)
            samples = gen(mine, params) if mine else []
            done(f"{len(samples) * d.world} samples")
        m = self.score.rewards.score(samples) if samples and self.score.rewards is not None else {}
        self.records = gather_records(eval_records(samples), d)
        # custom generate functions and agents: their samples count their engine calls in "turns"
        custom = bool(cfg.rollout.custom_generate_function_path or self.agents is not None)
        correct, total, length, turns, errors, timeouts = d.sum([
            sum(s.reward > 0.5 for s in samples), len(samples), sum(len(s.response_ids) for s in samples),
            sum(s.metadata["turns"] if custom else 1 for s in samples), m.get("reward/errors", 0.0),
            m.get("reward/timeouts", 0.0)])
        return {"eval/accuracy": correct / max(total, 1), "eval/response_len": length / max(total, 1), "eval/n": total,
                "eval/turns": turns / max(total, 1), "eval/reward_errors": errors, "eval/reward_timeouts": timeouts}


def eval_records(samples: list[Sample]) -> list[dict]:
    """One JSON-ready row per eval sample (verl's validation dumps): prompt, response, label, reward, finish, length."""
    return [{"prompt": s.prompt, "response": s.response, "label": s.label, "reward": s.reward,
             "finish_reason": s.finish_reason, "response_len": len(s.response_ids)} for s in samples]


def gather_records(records: list[dict], d: Dist) -> list[dict]:
    """Every rank's records in rank order (each rank evaluates its contiguous share of the prompts)."""
    if d.world == 1:
        return records
    import torch.distributed as dist
    parts: list = [None] * d.world
    dist.all_gather_object(parts, records, group=d.group)
    return [r for part in parts for r in part]


def write_records(path: str, records: list[dict]) -> None:
    import json
    import os
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(r, default=str) + "\n" for r in records)


@contextlib.contextmanager
def heartbeat(what: str, every_s: float):
    """Lines on stderr while a long call runs: `what` at the start and every `every_s` seconds with the time so far;
    the caller's done(summary) line at the end. every_s 0: no lines."""
    import threading
    import time

    from polyrl.metrics import notice
    t0, stop = time.perf_counter(), threading.Event()

    def tick():
        while not stop.wait(every_s):
            notice(f"{what}: {time.perf_counter() - t0:.0f} s so far")

    def done(summary: str) -> None:
        if every_s:
            notice(f"{what}: {summary} in {time.perf_counter() - t0:.1f} s")
    thread = threading.Thread(target=tick, daemon=True, name="polyrl-heartbeat") if every_s else None
    if thread is not None:
        notice(f"{what} ...")
        thread.start()
    try:
        yield done
    finally:
        stop.set()
        if thread is not None:
            thread.join(timeout=every_s + 1)
