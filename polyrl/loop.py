"""The synchronous RL loop: generate -> score -> advantages -> train -> sync weights.

`Run` holds what every loop builds (data, backend, engine, rewards, transport, logger) and the
parts of a step both loops share: `rollout` (draw and generate; with dynamic sampling also score and
filter, drawing again until the step is full), `learn` (reward, advantages, train), `sync_weights`,
`finish_step` (metrics, eval, checkpoint). `train` below runs them in order; `polyrl/loop_async.py`
runs the same parts with generation one or more steps ahead.
Debug modes live in these parts, not in `train`: --debug-train-only reads each step's samples from files
(`generate`, no engine is built), --debug-rollout-only stops `learn` after scoring and skips `sync_weights`,
and --save-debug-rollout-data writes the scored samples in `learn` (polyrl/debug_rollout.py: the format).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time

import torch

from polyrl import runtime as rt
from polyrl.algorithms.advantages import KL_IN_REWARD_ESTIMATORS, advantages_and_returns, needs_critic
from polyrl.algorithms.distill import opd_advantages, opd_metrics, opd_sums
from polyrl.algorithms.losses import CriticSettings, LossSettings, critic_loss, explained_variance, rl_loss
from polyrl.algorithms.shaping import overlong_penalty
from polyrl.checkpoint import critic_hf_dir, load_checkpoint, save_checkpoint
from polyrl.config import Config, ConfigError
from polyrl.debug_rollout import rollout_files
from polyrl.metrics import Timer, logger_from_config, notice
from polyrl.rewards import RewardManager, reward_metrics
from polyrl.rollout.dynamic_sampling import DynamicSampler
from polyrl.types import Sample, TrainBatch


def loss_settings(cfg: Config) -> LossSettings:
    a = cfg.algorithm
    return LossSettings(
        eps_clip=a.eps_clip, eps_clip_high=a.eps_clip_high, eps_clip_c=a.eps_clip_c, policy_loss=a.policy_loss,
        loss_agg_mode=a.loss_agg_mode,
        sequence_ratio=a.advantage_estimator == "gspo", use_kl_loss=a.use_kl_loss, kl_loss_coef=a.kl_loss_coef,
        kl_loss_type=a.kl_loss_type, entropy_coef=a.entropy_coef, use_tis=a.use_tis, tis_clip=a.tis_clip,
        norm_len=float(cfg.rollout.rollout_max_response_len))


class Run:
    """Everything a training run builds, once, and the step parts both loops share."""

    def __init__(self, cfg: Config, title: str = "polyrl train"):
        self.cfg = cfg
        self.device, self.d = rt.setup(cfg)
        r, a, d = cfg.rollout, cfg.algorithm, self.d
        if r.rollout_batch_size % d.world:
            raise ConfigError(f"--rollout-batch-size {r.rollout_batch_size} must be a multiple of the {d.world} ranks "
                              "(each rank samples whole prompt groups)")
        if (r.over_sampling_batch_size or 0) % d.world:
            raise ConfigError(f"--over-sampling-batch-size {r.over_sampling_batch_size} must be a multiple of the {d.world} "
                              "ranks (each rank samples whole prompt groups)")
        self.sampler = DynamicSampler(r.dynamic_sampling_filter_path, d) if r.dynamic_sampling_filter_path else None
        self.data_lock = threading.Lock()  # the async loop draws on its rollout thread and saves on the main thread
        self.data_states: dict[int, dict] = {}  # step -> dataset position before its prompts (drawn, not yet finished)
        self.tok = rt.load_tokenizer(cfg)
        self.dataset = rt.prompt_dataset(cfg, self.tok, cfg.data.prompt_data, shuffle=cfg.data.rollout_shuffle)
        self.eval_set = (rt.prompt_dataset(cfg, self.tok, cfg.data.eval_prompt_data, shuffle=False)
                         if cfg.data.eval_prompt_data else None)
        per_step = r.rollout_batch_size * r.n_samples_per_prompt
        self.n_minibatches = per_step // (cfg.batch.global_batch_size or per_step)
        self.kl_in_reward = a.advantage_estimator in KL_IN_REWARD_ESTIMATORS and a.kl_coef > 0
        self.need_ref = a.use_kl_loss or self.kl_in_reward
        self.opd = bool(cfg.model.opd_teacher_load)  # on-policy distillation: a teacher scores every sampled token
        self.backend = rt.build_backend(cfg, self.device, total_steps=r.num_rollout * self.n_minibatches, need_ref=self.need_ref,
                                        need_teacher=self.opd)
        # PPO's critic (--advantage-estimator gae): another backend of the same kind, trained in the same phase
        self.critic = (rt.build_critic(cfg, self.device, total_steps=r.num_rollout * self.n_minibatches)
                       if needs_critic(a.advantage_estimator) else None)
        self.critic_loss_fn = functools.partial(critic_loss, s=CriticSettings(
            value_clip=a.value_clip, loss_agg_mode=a.loss_agg_mode, norm_len=float(r.rollout_max_response_len)))
        self.engine = rt.build_engine(cfg, self.device)  # --debug-train-only: a NoEngine
        rc = cfg.reward  # --debug-train-only without a reward flag keeps the rewards saved with the samples
        self.rewards = RewardManager.from_config(rc) if (rc.rm_type or rc.custom_rm_path or rc.rm_url) else None
        self.rollout_files = rollout_files(cfg, self.tok, d.rank, d.world)  # --save/--load-debug-rollout-data
        self.transport = rt.build_transport(cfg, self.device, self.engine)
        self.logger = logger_from_config(cfg, total_steps=r.num_rollout, enabled=d.is_main, title=title)
        self.loss_fn = functools.partial(rl_loss, s=loss_settings(cfg))
        # held around every engine call; the async loop makes it a real lock for an engine whose weights cannot change
        # under a running generate (engine.concurrent_update False: the in-process ones)
        self.engine_lock = contextlib.nullcontext()
        self.start = 0
        if cfg.checkpoint.load:
            state = load_checkpoint(cfg.checkpoint.load, self.backend, critic=self.critic)
            self.start = state["step"]
            self.dataset.load_state_dict(state["data"])
            self.push_weights(self.start)  # the engine must sample from the resumed policy
        if self.start >= r.num_rollout:  # say so: a run that trains nothing must not look like one that finished
            notice(f"nothing to train: the checkpoint is at step {self.start}, at or past --num-rollout {r.num_rollout}; raise "
                   "--num-rollout to train on" if cfg.checkpoint.load else "nothing to train: --num-rollout 0 (no RL step runs)")
        elif self.start:
            notice(f"resuming at step {self.start + 1} of --num-rollout {r.num_rollout}")
        if self.eval_set is not None and cfg.log.eval_interval and self.start == 0:  # the curve starts from the initial policy
            self.logger.log(0, self.evaluate())
        self._t_step = time.perf_counter()  # time/step: wall time between two steps' logs, all phases and overheads included

    def profiled(self, step: int):
        """A context for step `step` (0-based): torch.profiler around it when --profile-step names it."""
        if self.cfg.log.profile_step != step + 1:
            return contextlib.nullcontext()
        from polyrl.metrics import step_profiler
        return step_profiler(self.cfg.log.run_dir, step + 1, self.device, enabled=self.d.is_main)

    def draw(self, step: int) -> list:
        """This rank's prompts of the next draw of `step` (--over-sampling-batch-size of them with dynamic sampling)."""
        r = self.cfg.rollout
        with self.data_lock:
            self.data_states.setdefault(step, self.dataset.state_dict())
            return self.d.shard(self.dataset.next_batch(r.over_sampling_batch_size or r.rollout_batch_size))

    def data_state_before(self, step: int) -> dict:
        """The dataset position before the prompts of `step`, whether they were drawn already or not (the async loop
        draws ahead; steps are drawn in order, so one not drawn yet starts at the current position)."""
        with self.data_lock:
            state = self.data_states.get(step, self.dataset.state_dict())
            for k in [k for k in self.data_states if k <= step]:
                del self.data_states[k]
            return state

    def generate(self, items: list, step: int, draw: int = 0) -> list[Sample]:
        r, d = self.cfg.rollout, self.d
        if self.cfg.debug.train_only:  # the step's samples as a run with --save-debug-rollout-data scored them
            return self.rollout_files.load(step)
        seed = r.rollout_seed + step * d.world + d.rank + draw * r.num_rollout * d.world  # distinct for every (draw, step, rank)
        params = rt.sampling_params(self.cfg, seed=seed)
        with self.engine_lock:  # with a --custom-generate-function-path, the user's function drives the engine
            return rt.generate(self.cfg, self.engine, self.tok, items, params)

    def score(self, samples: list[Sample]) -> dict[str, float]:
        """Set every sample's reward (with DAPO's overlong penalty when --overlong-buffer-len is set); this rank's
        reward metrics (reward/mean and reward/accuracy are the reward function's, before the penalty)."""
        m, rw = self.rewards.score(samples), self.cfg.reward
        if rw.overlong_buffer_len:
            pen = overlong_penalty(torch.tensor([len(s.response_ids) for s in samples]), buffer_len=rw.overlong_buffer_len,
                                   max_len=self.cfg.rollout.rollout_max_response_len, factor=rw.overlong_penalty_factor)
            for s, p in zip(samples, pen.tolist()):
                s.reward += p
            m["reward/overlong_penalty"] = pen.sum().item() / max(len(samples), 1)
        return m

    def rollout(self, step: int) -> tuple[list[Sample], dict | None, dict]:
        """This rank's samples of one step: (samples, reward metrics or None when not scored yet, step metrics).
        Without a dynamic sampling filter: one draw, generated; `learn` scores it. With one: DynamicSampler.fill."""
        if self.sampler is None:
            return self.generate(self.draw(step), step), None, {}
        return self.sampler.fill(self, step)

    def evaluate(self) -> dict[str, float]:
        with self.engine_lock:
            return rt.evaluate(self.cfg, self.engine, self.eval_set, self.rewards, self.d)

    def learn(self, samples: list[Sample], step: int, m: dict, timer: Timer, scored: dict | None = None) -> None:
        """Score, compute advantages and train on one step's samples (whatever policy version produced them).
        scored: this rank's reward metrics when the samples were scored already (the async loop scores them
        on its rollout thread); the ranks' metrics are averaged here, on the thread that runs the collectives.
        --debug-rollout-only: scoring only (and saving the samples if asked)."""
        cfg, r, a, d, backend = self.cfg, self.cfg.rollout, self.cfg.algorithm, self.d, self.backend
        with timer("reward"):
            rm = scored if scored is not None else self.score(samples) if self.rewards else reward_metrics(samples)
            m.update({k: v / d.world for k, v in zip(rm, d.sum(list(rm.values())))})
        if cfg.debug.save_debug_rollout_data:
            self.rollout_files.save(step, samples)
        if cfg.debug.debug_rollout_only:
            return
        with timer("train"):
            backend.onload()
            batch = rt.to_train_batch(samples)
            # later minibatches are off-policy: keep the pre-update logprobs (OPD's student logprobs are these too)
            if self.n_minibatches > 1 or self.kl_in_reward or self.opd:
                batch.token_fields["old_logprobs"] = backend.compute_logprobs(batch, temperature=r.rollout_temperature)
            if self.need_ref:
                batch.token_fields["ref_logprobs"] = backend.compute_logprobs(batch, model="ref", temperature=r.rollout_temperature)
            if self.opd:
                teacher = torch.cat(backend.compute_logprobs(batch, model="teacher", temperature=r.rollout_temperature))
            lens = batch.response_lens
            seq_ids = torch.repeat_interleave(torch.arange(len(samples)), torch.tensor(lens))
            kl = None
            if self.kl_in_reward:
                kl = torch.cat(batch.token_fields["old_logprobs"]) - torch.cat(batch.token_fields["ref_logprobs"])
            values = self.critic_values(batch)
            # group_size: --n-samples-per-prompt, times the samples per call of a --custom-generate-function-path
            adv, returns = advantages_and_returns(
                a.advantage_estimator, torch.tensor([s.reward for s in samples]), seq_ids,
                group_size=len(samples) * d.world // r.rollout_batch_size, normalize_std=not a.disable_grpo_std_normalization,
                kl=kl, kl_coef=a.kl_coef, gamma=a.gamma, lambd=a.lambd, values=values,
                loss_mask=torch.cat(batch.token_fields["loss_mask"]), reduce=d.sum)
            if self.opd:
                student, mask = torch.cat(batch.token_fields["old_logprobs"]), torch.cat(batch.token_fields["loss_mask"])
                adv = opd_advantages(adv, student, teacher, coef=a.opd_coef, loss_mask=mask)
                m.update(opd_metrics(d.sum(opd_sums(student, teacher, mask))))
            batch.token_fields["advantages"] = list(adv.split(lens))
            if self.critic is not None:  # verl's order: the critic's update, then the actor's
                self.train_critic(batch, values, returns, m)
            self.minibatch_steps(backend, batch, self.loss_fn, m, "", with_entropy=True)
            if a.ref_update_interval and (step + 1) % a.ref_update_interval == 0:
                backend.sync_ref_from_actor()

    def minibatch_steps(self, backend, batch, loss_fn, m: dict, prefix: str, with_entropy: bool = False) -> None:
        """One optimizer step per --global-batch-size share of this step's samples; metrics averaged over them."""
        per_rank = len(batch) // self.n_minibatches
        for k in range(self.n_minibatches):
            tm = backend.train_step(batch.select(list(range(k * per_rank, (k + 1) * per_rank))), loss_fn,
                                    temperature=self.cfg.rollout.rollout_temperature, with_entropy=with_entropy)
            for key, v in tm.items():
                m[prefix + key] = m.get(prefix + key, 0.0) + v / self.n_minibatches

    def critic_values(self, batch) -> torch.Tensor | None:
        """The critic's pre-update values of this step's response tokens, flat [T] (None without a critic)."""
        if self.critic is None:
            return None
        self.critic.onload()
        return torch.cat(self.critic.compute_values(batch))

    def train_critic(self, batch, values: torch.Tensor, returns: torch.Tensor, m: dict) -> None:
        """The critic's update on GAE's returns (value loss clipped around `values`); metrics under critic/."""
        lens, mask = batch.response_lens, batch.token_fields["loss_mask"]
        m["critic/vf_explained_var"] = explained_variance(values, returns, torch.cat(mask), self.d.sum)
        cb = TrainBatch(batch.input_ids, batch.prompt_lens, {"loss_mask": mask, "old_values": list(values.split(lens)),
                                                             "returns": list(returns.split(lens))})
        self.minibatch_steps(self.critic, cb, self.critic_loss_fn, m, "critic/")
        self.critic.offload()

    def sync_weights(self, version: int) -> None:
        """After a step. --debug-rollout-only never changes the weights, --debug-train-only has no engine: nothing to send."""
        if not (self.cfg.debug.debug_rollout_only or self.cfg.debug.train_only):
            self.push_weights(version)

    def push_weights(self, version: int) -> None:
        # Colocated: the engine's weights come back first and take the update straight from the trainer's GPU copy;
        # the trainer leaves only then, and the KV cache returns into the memory it freed (no-ops where nothing is shared).
        self.engine.wake(("weights",))
        with self.engine_lock:
            self.transport.push(self.backend.export_weights(), [self.engine], version=version)
        self.backend.offload()
        self.engine.wake(("kv_cache",))

    def finish_step(self, step: int, samples: list[Sample], m: dict, timer: Timer, rollout_s: float) -> None:
        """Step metrics, eval, checkpoint; `step` is 0-based, the policy is now at version step + 1."""
        cfg, d = self.cfg, self.d
        data_state = self.data_state_before(step + 1)  # where a resume draws the next step's prompts
        n_resp, n_tok, n_trunc = d.sum([len(samples), sum(len(s.response_ids) for s in samples),
                                        sum(s.finish_reason == "length" for s in samples)])
        m.update(self.engine.stats())
        m.update({"response_len/mean": n_tok / max(n_resp, 1), "dropped_prompts": self.dataset.num_dropped,
                  "truncated_frac": n_trunc / max(n_resp, 1), "tokens_per_s": n_tok / max(rollout_s, 1e-9)})
        last = step + 1 == cfg.rollout.num_rollout
        if self.eval_set is not None and cfg.log.eval_interval and ((step + 1) % cfg.log.eval_interval == 0 or last):
            with timer("eval"):
                m.update(self.evaluate())
        now = time.perf_counter()
        m.update({f"time/{k}": v for k, v in timer.times.items()})
        m["time/step"], self._t_step = now - self._t_step, now
        # what no phase accounts for (metrics reduction, logging, Python between phases, the previous step's save)
        m["time/other"] = m["time/step"] - sum(timer.times.values())
        self.logger.log(step + 1, m)
        if cfg.checkpoint.save and (last or (cfg.checkpoint.save_interval and (step + 1) % cfg.checkpoint.save_interval == 0)):
            self.save(step + 1, data_state)

    def save(self, step: int, data_state: dict) -> None:
        save_checkpoint(self.cfg.checkpoint.save, step, self.backend,
                        {"step": step, "data": data_state, "config": dataclasses.asdict(self.cfg)},
                        keep=self.cfg.checkpoint.max_ckpt_to_keep, critic=self.critic)

    def close(self) -> None:
        self.logger.close()
        if self.rewards is not None:
            self.rewards.close()
        self.engine.close()  # launched servers stop here (and at exit, on an error)
        if self.cfg.checkpoint.save_hf:
            self.backend.save_hf(self.cfg.checkpoint.save_hf, self.tok, adapter=self.cfg.checkpoint.save_hf_adapter)
            if self.critic is not None:  # beside the actor: an HF directory --critic-load reads back
                self.critic.save_hf(critic_hf_dir(self.cfg.checkpoint.save_hf), self.tok)


def train(cfg: Config) -> dict:
    run = Run(cfg)
    n, m = cfg.rollout.num_rollout, {}
    t_run = time.perf_counter()
    for step in range(run.start, n):
        timer = Timer()
        with run.profiled(step):
            with timer("rollout"):
                run.backend.offload()
                samples, scored, m = run.rollout(step)  # scored: the reward metrics when dynamic sampling scored them
                if not cfg.debug.debug_rollout_only:  # nothing trains then: the engine keeps its memory
                    run.engine.sleep()  # colocated: the trainer gets the GPU
            run.learn(samples, step, m, timer, scored)
            with timer("weight_sync"):
                run.sync_weights(step + 1)
        run.finish_step(step, samples, m, timer, timer.times["rollout"])
    run.close()
    return {"steps": n - run.start, "wall_seconds": time.perf_counter() - t_run, "last": m if n > run.start else {}}
