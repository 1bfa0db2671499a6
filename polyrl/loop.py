"""The synchronous RL loop: generate -> score -> advantages -> train -> sync weights."""

from __future__ import annotations

import dataclasses
import functools
import time

import torch

from polyrl import runtime as rt
from polyrl.algorithms.advantages import compute_advantages
from polyrl.algorithms.losses import LossSettings, rl_loss
from polyrl.checkpoint import load_checkpoint, save_checkpoint
from polyrl.config import Config, ConfigError
from polyrl.metrics import MetricsLogger, Timer, notice
from polyrl.rewards import RewardManager


def loss_settings(cfg: Config) -> LossSettings:
    a = cfg.algorithm
    return LossSettings(
        eps_clip=a.eps_clip, eps_clip_high=a.eps_clip_high, eps_clip_c=a.eps_clip_c, loss_agg_mode=a.loss_agg_mode,
        sequence_ratio=a.advantage_estimator == "gspo", use_kl_loss=a.use_kl_loss, kl_loss_coef=a.kl_loss_coef,
        kl_loss_type=a.kl_loss_type, entropy_coef=a.entropy_coef, use_tis=a.use_tis, tis_clip=a.tis_clip,
        norm_len=float(cfg.rollout.rollout_max_response_len))


def train(cfg: Config) -> dict:
    device, d = rt.setup(cfg)
    r, a = cfg.rollout, cfg.algorithm
    if r.rollout_batch_size % d.world:
        raise ConfigError(f"--rollout-batch-size {r.rollout_batch_size} must be a multiple of the {d.world} ranks "
                          "(each rank samples whole prompt groups)")
    tok = rt.load_tokenizer(cfg)
    dataset = rt.prompt_dataset(cfg, tok, cfg.data.prompt_data, shuffle=cfg.data.rollout_shuffle)
    eval_set = rt.prompt_dataset(cfg, tok, cfg.data.eval_prompt_data, shuffle=False) if cfg.data.eval_prompt_data else None
    per_step = r.rollout_batch_size * r.n_samples_per_prompt
    n_minibatches = per_step // (cfg.batch.global_batch_size or per_step)
    need_ref = a.use_kl_loss or (a.advantage_estimator == "reinforce_plus_plus" and a.kl_coef > 0)
    backend = rt.build_backend(cfg, device, total_steps=r.num_rollout * n_minibatches, need_ref=need_ref)
    engine = rt.build_engine(cfg, device)
    rewards = RewardManager.from_config(cfg.reward)
    transport = rt.build_transport(cfg, device, engine)
    logger = MetricsLogger(cfg.log.run_dir, total_steps=r.num_rollout, use_tensorboard=cfg.log.use_tensorboard,
                           quiet=cfg.log.quiet, enabled=d.is_main, title="polyrl train")
    loss_fn = functools.partial(rl_loss, s=loss_settings(cfg))
    start = 0
    if cfg.checkpoint.load:
        state = load_checkpoint(cfg.checkpoint.load, backend)
        start = state["step"]
        dataset.load_state_dict(state["data"])
        transport.push(backend.export_weights(), [engine], version=start)  # the engine must sample from the resumed policy
    if start >= r.num_rollout:  # say so: a run that trains nothing must not look like one that finished
        notice(f"nothing to train: the checkpoint is at step {start}, at or past --num-rollout {r.num_rollout}; raise "
               "--num-rollout to train on" if cfg.checkpoint.load else "nothing to train: --num-rollout 0 (no RL step runs)")
    elif start:
        notice(f"resuming at step {start + 1} of --num-rollout {r.num_rollout}")
    if eval_set is not None and cfg.log.eval_interval and start == 0:  # the curve starts from the initial policy
        logger.log(0, rt.evaluate(cfg, engine, eval_set, rewards, d))
    t_run = time.perf_counter()
    for step in range(start, r.num_rollout):
        timer, m = Timer(), {}
        items = d.shard(dataset.next_batch(r.rollout_batch_size))
        with timer("rollout"):
            backend.offload()
            samples = rt.rollout(engine, items, rt.sampling_params(cfg, seed=r.rollout_seed + step * d.world + d.rank))
        with timer("reward"):
            rm = rewards.score(samples)
            m.update({k: v / d.world for k, v in zip(rm, d.sum(list(rm.values())))})
        with timer("train"):
            engine.sleep()
            backend.onload()
            batch = rt.to_train_batch(samples)
            kl_in_reward = a.advantage_estimator == "reinforce_plus_plus" and a.kl_coef > 0
            if n_minibatches > 1 or kl_in_reward:  # later minibatches are off-policy: keep the pre-update logprobs
                batch.token_fields["old_logprobs"] = backend.compute_logprobs(batch, temperature=r.rollout_temperature)
            if need_ref:
                batch.token_fields["ref_logprobs"] = backend.compute_logprobs(batch, model="ref", temperature=r.rollout_temperature)
            lens = batch.response_lens
            seq_ids = torch.repeat_interleave(torch.arange(len(samples)), torch.tensor(lens))
            kl = None
            if kl_in_reward:
                kl = torch.cat(batch.token_fields["old_logprobs"]) - torch.cat(batch.token_fields["ref_logprobs"])
            adv = compute_advantages(a.advantage_estimator, torch.tensor([s.reward for s in samples]), seq_ids,
                                     group_size=r.n_samples_per_prompt, normalize_std=not a.disable_grpo_std_normalization,
                                     kl=kl, kl_coef=a.kl_coef, gamma=a.gamma, loss_mask=torch.cat(batch.token_fields["loss_mask"]),
                                     reduce=d.sum)
            batch.token_fields["advantages"] = list(adv.split(lens))
            per_rank = len(samples) // n_minibatches
            for k in range(n_minibatches):
                tm = backend.train_step(batch.select(list(range(k * per_rank, (k + 1) * per_rank))), loss_fn,
                                        temperature=r.rollout_temperature, with_entropy=True)
                for key, v in tm.items():
                    m[key] = m.get(key, 0.0) + v / n_minibatches
            if a.ref_update_interval and (step + 1) % a.ref_update_interval == 0:
                backend.sync_ref_from_actor()
        with timer("weight_sync"):
            backend.offload()
            engine.wake()
            transport.push(backend.export_weights(), [engine], version=step + 1)
        n_resp, n_tok, n_trunc = d.sum([len(samples), sum(lens), sum(s.finish_reason == "length" for s in samples)])
        m.update(engine.stats())
        m.update({"response_len/mean": n_tok / max(n_resp, 1), "dropped_prompts": dataset.num_dropped,
                  "truncated_frac": n_trunc / max(n_resp, 1),
                  "tokens_per_s": n_tok / max(timer.times["rollout"], 1e-9), **{f"time/{k}": v for k, v in timer.times.items()}})
        if eval_set is not None and cfg.log.eval_interval and ((step + 1) % cfg.log.eval_interval == 0 or step + 1 == r.num_rollout):
            m.update(rt.evaluate(cfg, engine, eval_set, rewards, d))
        logger.log(step + 1, m)
        if cfg.checkpoint.save and (step + 1 == r.num_rollout or (cfg.checkpoint.save_interval and (step + 1) % cfg.checkpoint.save_interval == 0)):
            save_checkpoint(cfg.checkpoint.save, step + 1, backend, {"step": step + 1, "data": dataset.state_dict(),
                                                                    "config": dataclasses.asdict(cfg)},
                            keep=cfg.checkpoint.max_ckpt_to_keep)
    logger.close()
    engine.close()  # launched servers stop here (and at exit, on an error)
    if cfg.checkpoint.save_hf:
        backend.save_hf(cfg.checkpoint.save_hf, tok)
    return {"steps": r.num_rollout - start, "wall_seconds": time.perf_counter() - t_run, "last": m if r.num_rollout > start else {}}
