"""Policy losses, KL estimators, truncated importance sampling and loss aggregation.

Same flat layout as advantages.py: per-token tensors are ``[T]`` (response tokens of the
micro-batch concatenated), ``seq_ids: [T]`` maps tokens to sequences ``0..S-1`` and
``mask: [T]`` is the loss mask (1 = trained token).

Aggregation takes *global* denominators (tokens / sequences of the whole optimizer step,
over all micro-batches and ranks), so the summed gradient does not depend on how the step
was split into micro-batches or ranks: the bug class where token-mean is taken per
micro-batch and then averaged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")


def merge_metric(acc: dict, key: str, value, parts: int = 1) -> None:
    """Fold one micro-batch's (or rank's, or minibatch's) metric into acc: a `*_max` metric keeps the largest value, the
    others add up (divided by parts for a mean over them). Tensors stay on their device (no sync per metric)."""
    if key.endswith("_max") and key in acc:
        old = acc[key]
        acc[key] = torch.maximum(old, value) if isinstance(old, torch.Tensor) else max(old, value)
    elif key.endswith("_max"):
        acc[key] = value
    else:
        acc[key] = acc.get(key, 0.0) + (value / parts if parts != 1 else value)


def seq_sum(x: torch.Tensor, seq_ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Sum of per-token x for each sequence. x: [T] -> [S]"""
    return torch.zeros(num_seqs, dtype=x.dtype, device=x.device).index_add(0, seq_ids, x)


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    mode: str,
    *,
    num_tokens: float,
    num_seqs: float,
    norm_len: float = 1.0,
) -> torch.Tensor:
    """Reduce per-token loss [T] to a scalar with global denominators.

    token-mean:              sum_t l_t / num_tokens
    seq-mean-token-mean:     sum_s (mean_{t in s} l_t) / num_seqs
    seq-mean-token-sum:      sum_s (sum_{t in s} l_t) / num_seqs
    seq-mean-token-sum-norm: sum_s (sum_{t in s} l_t) / (num_seqs * norm_len)   (Dr.GRPO)
    """
    lm = loss * mask
    if mode == "token-mean":
        return lm.sum() / max(num_tokens, 1.0)
    n_local = int(seq_ids.max().item()) + 1 if seq_ids.numel() else 0
    per_seq = seq_sum(lm, seq_ids, n_local)
    if mode == "seq-mean-token-mean":
        count = seq_sum(mask.to(lm.dtype), seq_ids, n_local).clamp(min=1.0)
        return (per_seq / count).sum() / max(num_seqs, 1.0)
    if mode == "seq-mean-token-sum":
        return per_seq.sum() / max(num_seqs, 1.0)
    if mode == "seq-mean-token-sum-norm":
        return per_seq.sum() / (max(num_seqs, 1.0) * norm_len)
    raise ValueError(f"--loss-agg-mode {mode!r} is unknown; choose one of {AGG_MODES}")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimators (Schulman's k1/k2/k3). [T] -> [T]"""
    log_ratio = logprobs.float() - ref_logprobs.float()
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind in ("k3", "low_var_kl"):
        if kind == "low_var_kl":  # |log r| >= 20 is clamped to 10 below anyway; exp(88+) = inf gave a NaN gradient
            log_ratio = log_ratio.clamp(-20.0, 20.0)
        # k3 = r - log r - 1 with r = ref/pi: unbiased and always >= 0
        kl = torch.exp(-log_ratio) + log_ratio - 1.0
        return kl.clamp(-10.0, 10.0) if kind == "low_var_kl" else kl
    raise ValueError(f"--kl-loss-type {kind!r} is unknown; choose one of {KL_TYPES}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
    seq_ids: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    sequence_ratio: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO-clip surrogate with clip-higher and dual clip. All inputs [T].

    sequence_ratio=True is GSPO: the ratio is exp(mean log-ratio of the sequence), applied
    per token as sg[s_i] * pi_t / sg[pi_t] so the gradient is the sequence ratio's.
    Returns (per-token loss [T], clipped [T] bool, ratio [T]).
    """
    log_ratio = logprobs - old_logprobs
    if sequence_ratio:
        assert seq_ids is not None and mask is not None, "GSPO needs seq_ids and mask"
        n = int(seq_ids.max().item()) + 1
        m = mask.to(log_ratio.dtype)
        seq_lr = seq_sum(log_ratio.detach() * m, seq_ids, n) / seq_sum(m, seq_ids, n).clamp(min=1.0)
        log_ratio = seq_lr[seq_ids] + logprobs - logprobs.detach()
    ratio = torch.exp(log_ratio.clamp(max=20.0))  # clamp: a diverged token must not give inf
    high = eps_clip if eps_clip_high is None else eps_clip_high
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + high)
    loss = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    if eps_clip_c is not None:
        # dual clip (Ye et al. 2020): bound the loss of negative-advantage tokens by -c * A
        pg3 = -advantages * eps_clip_c
        dual = (advantages < 0) & (loss > pg3)
        loss = torch.where(advantages < 0, torch.minimum(loss, pg3), loss)
        clipped = clipped | dual
    return loss, clipped, ratio


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    **_,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1): REINFORCE weighted by the clipped, detached token importance ratio.

    loss_t = -sg(clip(r_t, 1 - eps_clip, 1 + eps_clip_high)) * A_t * logprobs_t,  r_t = exp(logprobs_t - old_t),
    so d loss_t / d logprobs_t = -clip(r_t) * A_t: a clipped token keeps its gradient (bounded weight),
    where PPO-clip would zero it. All inputs [T]; returns (per-token loss [T], clipped [T] bool, ratio [T]).
    """
    ratio = torch.exp((logprobs - old_logprobs).detach().clamp(max=20.0))  # clamp: a diverged token must not give inf
    high = eps_clip if eps_clip_high is None else eps_clip_high
    weight = ratio.clamp(1.0 - eps_clip, 1.0 + high)
    return -weight * advantages * logprobs, weight != ratio, ratio


# --policy-loss name -> (logprobs, old_logprobs, advantages, *, eps_clip, eps_clip_high, ...) -> (loss [T], clipped [T], ratio [T])
POLICY_LOSSES = {"ppo_clip": policy_loss, "cispo": cispo_loss}


def tis_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, clip: float) -> torch.Tensor:
    """Truncated importance sampling: min(pi_train_old / pi_rollout, clip), detached. [T] -> [T]"""
    return torch.exp(old_logprobs - rollout_logprobs).clamp(max=clip).detach()


@dataclass
class LossSettings:
    """The slice of the algorithm config the loss needs (kept small so backends can share it)."""

    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    eps_clip_c: float | None = None
    policy_loss: str = "ppo_clip"  # a POLICY_LOSSES name
    loss_agg_mode: str = "token-mean"
    sequence_ratio: bool = False  # GSPO
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    entropy_coef: float = 0.0
    use_tis: bool = False
    tis_clip: float = 2.0
    norm_len: float = 1.0


def rl_loss(
    logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    mb: dict[str, torch.Tensor],
    s: LossSettings,
    *,
    num_tokens: float,
    num_seqs: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Full RL objective for one micro-batch.

    mb holds flat [T] tensors: seq_ids, loss_mask, advantages, old_logprobs, and when used
    ref_logprobs and rollout_logprobs. Metrics come back pre-divided by the global token
    count, so summing them over micro-batches and ranks gives the step's token mean.
    """
    mask = mb["loss_mask"].to(logprobs.dtype)
    seq_ids = mb["seq_ids"]
    agg = lambda x: aggregate(x, mask, seq_ids, s.loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=s.norm_len)  # noqa: E731
    tok_mean = lambda x: (x.detach().float() * mask).sum() / max(num_tokens, 1.0)  # noqa: E731

    # one optimizer step per rollout is on-policy: the pre-update logprobs are these, detached
    old = mb["old_logprobs"] if "old_logprobs" in mb else logprobs.detach()
    pg, clipped, ratio = POLICY_LOSSES[s.policy_loss](
        logprobs, old, mb["advantages"], eps_clip=s.eps_clip, eps_clip_high=s.eps_clip_high,
        eps_clip_c=s.eps_clip_c, seq_ids=seq_ids, mask=mask, sequence_ratio=s.sequence_ratio,
    )
    metrics: dict[str, torch.Tensor] = {}
    if "rollout_logprobs" in mb:  # train/rollout mismatch, visible every step
        diff = (logprobs.detach().float() - mb["rollout_logprobs"].float()).abs() * mask
        if "this_version" in mb:  # --partial-rollout: tokens of older weights apart (the learner rescales the means)
            older = diff * (1 - mb["this_version"])
            diff = diff * mb["this_version"]
            metrics["train_rollout_logprob_abs_diff_older_weights"] = older.sum() / max(num_tokens, 1.0)
            metrics["train_rollout_logprob_abs_diff_older_weights_max"] = older.max() if older.numel() else older.new_zeros(())
        metrics["train_rollout_logprob_abs_diff"] = diff.sum() / max(num_tokens, 1.0)
        # the worst loss-masked token (masked ones count 0, which no |diff| is below); backends reduce *_max by max
        metrics["train_rollout_logprob_abs_diff_max"] = diff.max() if diff.numel() else diff.new_zeros(())
    if s.use_tis:
        w = tis_weights(old, mb["rollout_logprobs"], s.tis_clip)
        pg = pg * w
        metrics["tis_weight"] = tok_mean(w)
    loss = agg(pg)
    metrics["pg_loss"] = tok_mean(pg)
    metrics["clip_frac"] = tok_mean(clipped.float())
    metrics["ratio"] = tok_mean(ratio)
    if s.use_kl_loss:
        kl = kl_penalty(logprobs, mb["ref_logprobs"], s.kl_loss_type)
        loss = loss + s.kl_loss_coef * agg(kl)
        metrics["kl"] = tok_mean(kl)
    if entropy is not None:
        metrics["entropy"] = tok_mean(entropy)
        if s.entropy_coef:
            loss = loss - s.entropy_coef * agg(entropy)
    return loss, metrics


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, *, value_clip: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (PPO2 / verl / OpenRLHF): 0.5 * max((V - R)^2, (V_clip - R)^2) with
    V_clip = V_old + clamp(V - V_old, -value_clip, value_clip); value_clip 0 = unclipped. All inputs [T].
    Returns (per-token loss [T], clipped [T] bool: the clipped error was the larger one)."""
    unclipped = (values - returns).square()
    if not value_clip:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    v_clip = old_values + (values - old_values).clamp(-value_clip, value_clip)
    clipped = (v_clip - returns).square()
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped


@dataclass
class CriticSettings:
    value_clip: float = 0.5
    loss_agg_mode: str = "token-mean"
    norm_len: float = 1.0


def critic_loss(values: torch.Tensor, entropy, mb: dict[str, torch.Tensor], s: CriticSettings, *, num_tokens: float,
                num_seqs: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The critic's objective for one micro-batch, aggregated with the policy loss's global denominators.
    values: [T] the critic's current values; mb: loss_mask, seq_ids, returns and old_values (pre-update, [T])."""
    mask = mb["loss_mask"].to(values.dtype)
    vl, clipped = value_loss(values, mb["old_values"], mb["returns"], value_clip=s.value_clip)
    loss = aggregate(vl, mask, mb["seq_ids"], s.loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=s.norm_len)
    tok_mean = lambda x: (x.detach().float() * mask).sum() / max(num_tokens, 1.0)  # noqa: E731
    return loss, {"value_loss": tok_mean(vl), "vf_clipfrac": tok_mean(clipped.float()), "values_mean": tok_mean(values)}


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, reduce=None) -> float:
    """1 - Var(R - V) / Var(R) over the masked tokens of the (global, with `reduce`) batch: 1 for a perfect critic,
    0 for one that predicts the mean, negative for a worse one. [T] each.

    0.0 when Var(R) == 0 (every return of the step equal, e.g. all rewards 0 on a fresh zero head) or there are no
    tokens: there is no variance to explain, and 0.0 keeps the logged series finite and JSON-safe (NaN is not JSON).
    CleanRL / stable-baselines return NaN there; verl divides by Var(R) + 1e-5, which gives 1 for a perfect critic but
    -Var(V) / 1e-5 (any size) for the rest. Two passes (means, then centred squares) so equal returns give exactly
    Var(R) == 0: sum(x^2)/n - mean^2 leaves rounding of order n * 1e-16 * R^2 that would divide Var(R - V)."""
    m = mask.bool()
    d, r = (returns - values).double()[m], returns.double()[m]
    first = [float(m.sum()), float(d.sum()), float(r.sum())]
    n, ds, rs = reduce(first) if reduce is not None else first
    if n < 1:
        return 0.0
    second = [float((d - ds / n).square().sum()), float((r - rs / n).square().sum())]
    dd, rr = reduce(second) if reduce is not None else second
    return 1.0 - dd / rr if rr > 0 else 0.0


def sft_loss(
    logprobs: torch.Tensor, entropy, mb: dict[str, torch.Tensor], s: LossSettings | None = None, *, num_tokens: float, num_seqs: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Negative log-likelihood on loss-masked (response) tokens, token-mean over the step."""
    mask = mb["loss_mask"].to(logprobs.dtype)
    nll = -(logprobs * mask).sum() / max(num_tokens, 1.0)
    return nll, {"sft_loss": nll.detach()}
