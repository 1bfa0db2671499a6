"""The learner part: from a step's scored samples to updated weights. Log-prob passes (old policy, reference, OPD
teacher), advantages, PPO's critic, the actor's minibatches and the reference update. --debug-rollout-only substitutes
a learner that only reduces the reward metrics (ScoringLearner)."""

from __future__ import annotations

import functools
import itertools

import torch

from polyrl.algorithms.advantages import KL_IN_REWARD_ESTIMATORS, advantages_and_returns
from polyrl.algorithms.distill import opd_advantages, opd_metrics, opd_sums
from polyrl.algorithms.losses import CriticSettings, LossSettings, critic_loss, explained_variance, merge_metric, rl_loss
from polyrl.backends.base import TrainBackend
from polyrl.config import Config
from polyrl.dist import Dist
from polyrl.metrics import Timer
from polyrl.rewards import COUNT_METRICS
from polyrl.types import Sample, TrainBatch


def loss_settings(cfg: Config) -> LossSettings:
    a = cfg.algorithm
    return LossSettings(
        eps_clip=a.eps_clip, eps_clip_high=a.eps_clip_high, eps_clip_c=a.eps_clip_c, policy_loss=a.policy_loss,
        loss_agg_mode=a.loss_agg_mode,
        sequence_ratio=a.advantage_estimator == "gspo", use_kl_loss=a.use_kl_loss, kl_loss_coef=a.kl_loss_coef,
        kl_loss_type=a.kl_loss_type, entropy_coef=a.entropy_coef, use_tis=a.use_tis, tis_clip=a.tis_clip,
        norm_len=float(cfg.rollout.rollout_max_response_len))


def minibatches_per_step(cfg: Config) -> int:
    """Optimizer steps per RL step: one per --global-batch-size share of the step's samples."""
    per_step = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    return per_step // (cfg.batch.global_batch_size or per_step)


def needs_reference(cfg: Config) -> bool:
    a = cfg.algorithm
    return a.use_kl_loss or (a.advantage_estimator in KL_IN_REWARD_ESTIMATORS and a.kl_coef > 0)


def to_train_batch(samples: list[Sample]) -> TrainBatch:
    # one tensor per field for the whole batch, split into per-sample views (not one tensor per sample and field)
    lens, rlens = [s.num_tokens for s in samples], [len(s.response_ids) for s in samples]

    def flat(rows, dtype, sizes):
        return list(torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=dtype).split(sizes))

    ids = flat((s.prompt_ids + s.response_ids for s in samples), torch.long, lens)
    if all(s.loss_mask is None for s in samples):
        mask = list(torch.ones(sum(rlens), dtype=torch.float32).split(rlens))
    else:
        mask = flat((s.loss_mask if s.loss_mask is not None else [1] * len(s.response_ids) for s in samples),
                    torch.float32, rlens)
    routes = [s.routed_experts for s in samples]  # MoE: the engine's routes (R3), when every sample has them
    return TrainBatch(ids, [len(s.prompt_ids) for s in samples], {
        "loss_mask": mask,
        "rollout_logprobs": flat((s.rollout_logprobs for s in samples), torch.float32, rlens),
    }, rollout_routed_experts=routes if samples and all(r is not None for r in routes) else None,
        multimodal=[s.multimodal for s in samples] if any(s.multimodal is not None for s in samples) else None)


def rollout_mismatch(train: list[torch.Tensor], rollout: list[torch.Tensor], mask: list[torch.Tensor],
                     d: Dist) -> dict[str, float]:
    """|train - rollout| log-prob of every loss-masked response token of the step, over all ranks: the mean per token
    and the worst token (per sample lists of [R_i] tensors), with where it is: *_max_sample, its sample's index in the
    step's batch (ranks hold contiguous shares), and *_max_token, its position in that sample's response."""
    diff = (torch.cat(train).float() - torch.cat(rollout).float()).abs() * torch.cat(mask)
    total, n = d.sum([diff.sum().item(), torch.cat(mask).sum().item()])
    (worst,) = d.max([diff.max().item() if diff.numel() else 0.0])
    key = torch.nan_to_num(diff, nan=float("inf"))  # a NaN token is the worst one
    local = float(key.max()) if key.numel() else -1.0
    (top,) = d.max([local])
    (winner,) = d.max([-float(d.rank) if key.numel() and local == top else -float(d.world)])  # the lowest such rank
    where = [-1.0, -1.0]
    if key.numel() and d.rank == -int(winner):
        j = int(key.argmax())
        ends = torch.tensor([int(x.numel()) for x in train]).cumsum(0)
        i = int(torch.searchsorted(ends, j, right=True))
        where = [float(d.rank * len(train) + i), float(j - (int(ends[i - 1]) if i else 0))]
    sample, token = d.max(where)
    return {"train_rollout_logprob_abs_diff": total / max(n, 1.0), "train_rollout_logprob_abs_diff_max": worst,
            "train_rollout_logprob_abs_diff_max_sample": sample, "train_rollout_logprob_abs_diff_max_token": token}


def reduce_reward_metrics(scored: dict, d: Dist) -> dict[str, float]:
    """The step's reward metrics over all ranks from each rank's own (on the thread that runs the default group's
    collectives): counts (reward/samples, reward/errors, ...) add up, and each mean is weighted by its rank's
    reward/samples, since with dynamic sampling the ranks may score different numbers of samples."""
    keys = sorted(scored)  # the same order on every rank
    n = scored.get("reward/samples", 1.0)  # metrics without a sample count: each rank weighs the same
    total, *sums = d.sum([n] + [scored[k] if k in COUNT_METRICS else scored[k] * n for k in keys])
    return {k: v if k in COUNT_METRICS else v / max(total, 1e-12) for k, v in zip(keys, sums)}


class ScoringLearner:
    """--debug-rollout-only: nothing trains; the step's reward metrics are still reduced and logged."""

    def __init__(self, d: Dist):
        self.d = d

    def update(self, samples: list[Sample], scored: dict, step: int, m: dict, timer: Timer) -> None:
        with timer("reward"):
            m.update(reduce_reward_metrics(scored, self.d))


class Learner:
    """One step's training on its scored samples, whatever policy version produced them."""

    def __init__(self, cfg: Config, backend: TrainBackend, d: Dist, critic: TrainBackend | None = None):
        a, r = cfg.algorithm, cfg.rollout
        self.cfg, self.backend, self.critic, self.d = cfg, backend, critic, d
        self.n_minibatches = minibatches_per_step(cfg)
        self.kl_in_reward = a.advantage_estimator in KL_IN_REWARD_ESTIMATORS and a.kl_coef > 0
        self.need_ref = needs_reference(cfg)
        self.opd = bool(cfg.model.opd_teacher_load)  # on-policy distillation: a teacher scores every sampled token
        self.temperature = r.rollout_temperature
        self.loss_fn = functools.partial(rl_loss, s=loss_settings(cfg))
        self.critic_loss_fn = functools.partial(critic_loss, s=CriticSettings(
            value_clip=a.value_clip, loss_agg_mode=a.loss_agg_mode, norm_len=float(r.rollout_max_response_len)))

    def update(self, samples: list[Sample], scored: dict, step: int, m: dict, timer: Timer) -> None:
        """scored: this rank's reward metrics of `samples` (reduced over the ranks here). Metrics go into `m`."""
        with timer("reward"):
            m.update(reduce_reward_metrics(scored, self.d))
        with timer("train"):
            self._train(samples, step, m)

    def _train(self, samples: list[Sample], step: int, m: dict) -> None:
        a, r, d, backend, T = self.cfg.algorithm, self.cfg.rollout, self.d, self.backend, self.temperature
        backend.onload()
        batch = to_train_batch(samples)
        # later minibatches are off-policy: keep the pre-update logprobs (OPD's student logprobs are these too)
        # --ci-train-rollout-logprob-abs-diff-threshold: the trainer's own pre-update pass, which names the worst token
        gate = self.cfg.log.ci_train_rollout_logprob_abs_diff_threshold is not None
        if self.n_minibatches > 1 or self.kl_in_reward or self.opd or gate:
            # --true-on-policy: the engine scored the samples with the trainer's function on these very weights, so
            # its log-probs are the pre-update ones bit for bit and the forward over the whole batch is skipped
            from_rollout = self.cfg.model.true_on_policy and not gate
            batch.token_fields["old_logprobs"] = (batch.token_fields["rollout_logprobs"] if from_rollout
                                                  else backend.compute_logprobs(batch, temperature=T))
            m["old_logprobs_from_rollout"] = float(from_rollout)
        if self.need_ref:
            batch.token_fields["ref_logprobs"] = backend.compute_logprobs(batch, model="ref", temperature=T)
        if self.opd:
            teacher = torch.cat(backend.compute_logprobs(batch, model="teacher", temperature=T))
        if any(s.token_versions is not None for s in samples):
            # --partial-rollout: the train/rollout mismatch is the engine's on the tokens these weights generated; a
            # resumed response's tokens from older weights measure the policy's drift (rl_loss: *_older_weights)
            batch.token_fields["this_version"] = [(torch.tensor(s.token_versions) == step).float()
                                                  if s.token_versions is not None else torch.ones(len(s.response_ids))
                                                  for s in samples]
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
        if "this_version" in batch.token_fields:  # rl_loss divides by every loss token: each mean over its own tokens
            mask = torch.cat(batch.token_fields["loss_mask"])
            now, total = d.sum([float((mask * torch.cat(batch.token_fields["this_version"])).sum()), float(mask.sum())])
            for key, n in (("train_rollout_logprob_abs_diff", now), ("train_rollout_logprob_abs_diff_older_weights",
                                                                    total - now)):
                if key in m and n:
                    m[key] = float(m[key]) * total / n
                elif key in m:  # no such token this step (--async: none of these weights): nothing was measured
                    del m[key], m[key + "_max"]
        old = batch.token_fields.get("old_logprobs")
        if old is not None and old is not batch.token_fields["rollout_logprobs"]:
            # the trainer's own pre-update pass over every token: later minibatches meet updated weights
            m.update(rollout_mismatch(batch.token_fields["old_logprobs"], batch.token_fields["rollout_logprobs"],
                                      batch.token_fields["loss_mask"], d))
        if a.ref_update_interval and (step + 1) % a.ref_update_interval == 0:
            backend.sync_ref_from_actor()

    def minibatch_steps(self, backend: TrainBackend, batch: TrainBatch, loss_fn, m: dict, prefix: str,
                        with_entropy: bool = False) -> None:
        """One optimizer step per --global-batch-size share of this step's samples; metrics averaged over them."""
        per_rank = len(batch) // self.n_minibatches
        for k in range(self.n_minibatches):
            tm = backend.train_step(batch.select(list(range(k * per_rank, (k + 1) * per_rank))), loss_fn,
                                    temperature=self.temperature, with_entropy=with_entropy)
            for key, v in tm.items():  # averaged over the minibatches; a *_max metric is the largest of theirs
                merge_metric(m, prefix + key, v, self.n_minibatches)

    def critic_values(self, batch: TrainBatch) -> torch.Tensor | None:
        """The critic's pre-update values of this step's response tokens, flat [T] (None without a critic)."""
        if self.critic is None:
            return None
        self.critic.onload()
        return torch.cat(self.critic.compute_values(batch))

    def train_critic(self, batch: TrainBatch, values: torch.Tensor, returns: torch.Tensor, m: dict) -> None:
        """The critic's update on GAE's returns (value loss clipped around `values`); metrics under critic/."""
        lens, mask = batch.response_lens, batch.token_fields["loss_mask"]
        m["critic/vf_explained_var"] = explained_variance(values, returns, torch.cat(mask), self.d.sum)
        cb = TrainBatch(batch.input_ids, batch.prompt_lens, {"loss_mask": mask, "old_values": list(values.split(lens)),
                                                             "returns": list(returns.split(lens))})
        self.minibatch_steps(self.critic, cb, self.critic_loss_fn, m, "critic/")
        self.critic.offload()
