"""Advantage estimators: pure functions over flat token tensors.

Layout used throughout polyrl's algorithms: the response tokens of all sequences are
concatenated into one flat tensor of length T; ``seq_ids: [T]`` (long) says which of the
N sequences each token belongs to. ``rewards: [N]``; samples of one prompt are adjacent,
``group_size`` of them per prompt (N % group_size == 0). Every estimator returns per-token
advantages ``[T]``; those in CRITIC_ESTIMATORS (gae) also take the critic's ``values: [T]`` and return
``(advantages [T], returns [T])``, the returns being the critic's targets.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

EPS = 1e-6


def _group_view(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.view(-1, group_size)


def group_baseline(rewards: torch.Tensor, group_size: int, normalize_std: bool = True) -> torch.Tensor:
    """GRPO's per-sequence advantage: (r - mean_group) / (std_group + eps). rewards: [N] -> [N]."""
    g = _group_view(rewards.float(), group_size)
    adv = g - g.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        adv = adv / (g.std(dim=1, keepdim=True) + EPS)  # unbiased std, as in the GRPO paper
    return adv.view(-1)


def grpo(rewards, seq_ids, *, group_size, normalize_std=True, **_) -> torch.Tensor:
    """GRPO: group-normalised sequence reward broadcast to every token. -> [T]"""
    return group_baseline(rewards, group_size, normalize_std)[seq_ids]


def dr_grpo(rewards, seq_ids, *, group_size, **_) -> torch.Tensor:
    """Dr.GRPO: mean-centred reward without std normalisation (pair it with a constant
    length normaliser, loss-agg-mode seq-mean-token-sum). -> [T]"""
    return group_baseline(rewards, group_size, normalize_std=False)[seq_ids]


def gspo(rewards, seq_ids, *, group_size, normalize_std=True, **_) -> torch.Tensor:
    """GSPO uses GRPO's advantages; its difference is the sequence-level ratio in the loss."""
    return grpo(rewards, seq_ids, group_size=group_size, normalize_std=normalize_std)


def _discounted_returns(token_rewards: torch.Tensor, seq_ids: torch.Tensor, gamma: float,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sequence reward-to-go over flat tokens (sequences are contiguous in seq_ids). With a loss mask only
    model tokens (mask 1) are steps: a masked (tool) token is not discounted over and takes the return of the
    model token after it."""
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros((), dtype=token_rewards.dtype)
    for t in range(token_rewards.numel() - 1, -1, -1):
        if t == token_rewards.numel() - 1 or seq_ids[t + 1] != seq_ids[t]:
            running = torch.zeros((), dtype=token_rewards.dtype)
        if mask is None or mask[t]:
            running = token_rewards[t] + gamma * running
        returns[t] = running
    return returns


def _last_tokens(seq_ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Index of each sequence's last model token (its last token when it has no model token). -> [N] long"""
    pos = torch.arange(seq_ids.numel())
    n = int(seq_ids.max().item()) + 1 if seq_ids.numel() else 0
    last = torch.full((n,), -1, dtype=torch.long).scatter_reduce(0, seq_ids, pos, "amax")
    if mask is None:
        return last
    model = torch.where(mask.bool(), pos, torch.full_like(pos, -1))
    last_model = torch.full((n,), -1, dtype=torch.long).scatter_reduce(0, seq_ids, model, "amax")
    return torch.where(last_model >= 0, last_model, last)


def _whiten(x: torch.Tensor, mask: torch.Tensor | None, reduce: Callable | None = None) -> torch.Tensor:
    """(x - mean) / (std + eps) over the (masked) tokens; `reduce` sums [count, sum, sum of squares]
    over data-parallel ranks so every rank whitens with the global batch statistics."""
    sel = (x if mask is None else x[mask.bool()]).double()
    stats = torch.stack([torch.tensor(float(sel.numel()), dtype=torch.float64), sel.sum(), (sel * sel).sum()])
    if reduce is not None:
        stats = torch.as_tensor(reduce(stats.tolist()), dtype=torch.float64)
    n, total, squares = stats.tolist()
    if n == 0:
        return x
    mean = total / n
    if n < 2:
        return x - mean
    var = max(squares - n * mean * mean, 0.0) / (n - 1)  # unbiased, as torch.std
    return ((x.double() - mean) / (var ** 0.5 + EPS)).to(x.dtype)


def reinforce_plus_plus(rewards, seq_ids, *, kl=None, kl_coef=0.0, gamma=1.0, loss_mask=None, reduce=None,
                        **_) -> torch.Tensor:
    """REINFORCE++: token rewards = -kl_coef * kl_t, plus the sequence reward on the last
    token; discounted returns; whitened over the whole (global, with `reduce`) batch. kl: [T] or None. -> [T]
    loss_mask: [T] or None; masked (tool) tokens get no KL, are no discount steps, never carry the sequence reward
    (it goes on the last model token) and do not enter the whitening statistics."""
    token_rewards = torch.zeros(seq_ids.numel(), dtype=torch.float32)
    if kl is not None and kl_coef:
        token_rewards -= kl_coef * (kl.float() if loss_mask is None else kl.float() * loss_mask.float())  # no KL on untrained (e.g. tool) tokens
    last = _last_tokens(seq_ids, loss_mask)  # the reward lands on the last model token: tool tokens are not actions
    token_rewards[last] += rewards.float()[seq_ids[last]]
    return _whiten(_discounted_returns(token_rewards, seq_ids, gamma, loss_mask), loss_mask, reduce)


def reinforce_plus_plus_baseline(rewards, seq_ids, *, group_size, loss_mask=None, reduce=None, **_) -> torch.Tensor:
    """REINFORCE++-baseline: group-mean baseline, then whitened over the (global) batch. -> [T]"""
    adv = group_baseline(rewards, group_size, normalize_std=False)[seq_ids]
    return _whiten(adv, loss_mask, reduce)


def _pad_index(seq_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """Where each flat token sits in a right-padded [N, L] view: (row [T], column [T], (N, L)); sequences are
    contiguous in seq_ids."""
    n = int(seq_ids.max().item()) + 1 if seq_ids.numel() else 0
    lens = torch.bincount(seq_ids, minlength=n)
    starts = torch.cumsum(lens, 0) - lens
    col = torch.arange(seq_ids.numel()) - starts[seq_ids]
    return seq_ids, col, (n, int(lens.max().item()) if n else 0)


def gae(rewards, seq_ids, *, values, kl=None, kl_coef=0.0, gamma=1.0, lambd=1.0, loss_mask=None, reduce=None,
        **_) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's generalised advantage estimation with a learned critic. values: [T] (the critic's value of the state
    before each response token), rewards: [N], kl: [T] or None. -> (advantages [T] whitened over the global batch,
    returns [T] = unwhitened advantages + values: the critic's targets).

    Token rewards as in REINFORCE++ (-kl_coef * kl_t, the sequence reward on the last model token). Per sequence,
    backwards over its model tokens: delta_t = r_t + gamma * V_next - V_t (V_next = 0 after the last one),
    A_t = delta_t + gamma * lambd * A_next. A masked (tool) token is no time step: the recursion skips it, and it
    takes the advantage and return of the model token after it (0 after the last); loss_mask None = all model tokens.
    Vectorised over sequences: one step per position, not per token."""
    mask = torch.ones(seq_ids.numel(), dtype=torch.bool) if loss_mask is None else loss_mask.bool()
    token_rewards = torch.zeros(seq_ids.numel(), dtype=torch.float32)
    if kl is not None and kl_coef:
        token_rewards -= kl_coef * kl.float() * mask.float()  # no KL on untrained (e.g. tool) tokens
    last = _last_tokens(seq_ids, loss_mask)
    token_rewards[last] += rewards.float()[seq_ids[last]]
    row, col, shape = _pad_index(seq_ids)
    r, v = torch.zeros(shape), torch.zeros(shape)
    step = torch.zeros(shape, dtype=torch.bool)  # padding is no step either
    r[row, col], v[row, col], step[row, col] = token_rewards, values.float().cpu(), mask
    adv, ret = torch.zeros_like(r), torch.zeros_like(r)
    running, next_v = r.new_zeros(r.shape[0]), r.new_zeros(r.shape[0])
    for t in range(r.shape[1] - 1, -1, -1):
        s = step[:, t]
        running = torch.where(s, r[:, t] + gamma * next_v - v[:, t] + gamma * lambd * running, running)
        next_v = torch.where(s, v[:, t], next_v)
        adv[:, t], ret[:, t] = running, running + next_v
    adv, ret = adv[row, col], ret[row, col]
    return _whiten(adv, loss_mask, reduce), ret


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Any]] = {
    "grpo": grpo,
    "gspo": gspo,
    "dr_grpo": dr_grpo,
    "reinforce_plus_plus": reinforce_plus_plus,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline,
    "gae": gae,  # returns (advantages, returns): see CRITIC_ESTIMATORS
}
# estimators that read a critic's `values` and return (advantages, returns); the loop builds a critic for these only
CRITIC_ESTIMATORS = frozenset({"gae"})
# estimators that put a per-token KL penalty (--kl-coef) into the token rewards: the loop computes `kl` for these
KL_IN_REWARD_ESTIMATORS = frozenset({"reinforce_plus_plus", "gae"})


def needs_critic(name: str) -> bool:
    return name in CRITIC_ESTIMATORS


def advantages_and_returns(name: str, rewards: torch.Tensor, seq_ids: torch.Tensor, **kwargs
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(advantages [T], the critic's value targets [T] for a CRITIC_ESTIMATORS name, else None)."""
    try:
        fn = ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"--advantage-estimator {name!r} is unknown; choose one of {sorted(ADVANTAGE_ESTIMATORS)}") from None
    if needs_critic(name) and kwargs.get("values") is None:
        raise ValueError(f"--advantage-estimator {name} needs the critic's values (values=[T])")
    out = fn(rewards, seq_ids, **kwargs)
    return out if needs_critic(name) else (out, None)


def compute_advantages(name: str, rewards: torch.Tensor, seq_ids: torch.Tensor, **kwargs) -> torch.Tensor:
    return advantages_and_returns(name, rewards, seq_ids, **kwargs)[0]
