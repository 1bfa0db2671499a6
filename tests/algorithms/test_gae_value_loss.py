"""PPO's critic as pure functions: GAE against a hand-worked example, the clipped value loss by hand,
explained variance, and GAE's limits (lambd = 1 with V = 0 is REINFORCE++, lambd = 0 is TD(0))."""

from __future__ import annotations

import pytest
import torch

from polyrl.algorithms.advantages import (
    _whiten, advantages_and_returns, gae, needs_critic, reinforce_plus_plus)
from polyrl.algorithms.losses import CriticSettings, critic_loss, explained_variance, value_loss

# two sequences: 3 tokens (the middle one a masked tool token) and 2 tokens
SEQ = torch.tensor([0, 0, 0, 1, 1])
MASK = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0])
VALUES = torch.tensor([0.5, 9.0, 0.2, 0.1, 0.3])  # 9.0 sits on the tool token: never read
KL = torch.tensor([0.0, 2.0, 0.0, 0.5, -0.5])  # 2.0 on the tool token: no penalty there
REWARDS = torch.tensor([1.0, 0.0])


def test_gae_matches_the_hand_worked_example_with_a_masked_token_and_gamma_lambda_below_one():
    # gamma 0.9, lambd 0.8, kl_coef 0.1. Token rewards: seq 0 gets its reward 1.0 on its last model token (t2);
    # seq 1: -0.1 * kl = [-0.05, +0.05] and its reward 0 on t4.
    # seq 0, backwards over model tokens t2, t0 (t1 is no step):
    #   t2: delta = 1.0 + 0.9 * 0 - 0.2 = 0.8;            A = 0.8;                          R = 0.8 + 0.2 = 1.0
    #   t1: the model token after it:                       A = 0.8;                          R = 1.0
    #   t0: delta = 0 + 0.9 * 0.2 - 0.5 = -0.32;          A = -0.32 + 0.9 * 0.8 * 0.8 = 0.256; R = 0.256 + 0.5 = 0.756
    # seq 1:
    #   t4: delta = 0.05 + 0 - 0.3 = -0.25;               A = -0.25;                        R = 0.05
    #   t3: delta = -0.05 + 0.9 * 0.3 - 0.1 = 0.12;       A = 0.12 + 0.72 * -0.25 = -0.06;  R = 0.04
    raw = torch.tensor([0.256, 0.8, 0.8, -0.06, -0.25])
    adv, ret = gae(REWARDS, SEQ, values=VALUES, kl=KL, kl_coef=0.1, gamma=0.9, lambd=0.8, loss_mask=MASK)
    torch.testing.assert_close(ret, torch.tensor([0.756, 1.0, 1.0, 0.04, 0.05]), rtol=0, atol=1e-6)  # fp32 sums of 3-4 terms
    # whitened over the 4 model tokens only (mean, unbiased std); the tool token is shifted and scaled with them
    sel = raw[MASK.bool()]
    torch.testing.assert_close(adv, (raw - sel.mean()) / (sel.std() + 1e-6), rtol=0, atol=1e-5)
    # through the table: advantages_and_returns gives the same pair; other estimators give returns None
    adv2, ret2 = advantages_and_returns("gae", REWARDS, SEQ, values=VALUES, kl=KL, kl_coef=0.1, gamma=0.9, lambd=0.8,
                                        loss_mask=MASK, group_size=1)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)
    assert advantages_and_returns("grpo", REWARDS, SEQ, group_size=2)[1] is None
    assert needs_critic("gae") and not needs_critic("reinforce_plus_plus")


def test_gae_without_values_is_refused():
    with pytest.raises(ValueError, match="critic's values"):
        advantages_and_returns("gae", REWARDS, SEQ, group_size=1)


def test_gae_with_lambda_one_and_zero_values_is_reinforce_plus_plus():
    # V = 0, lambd = 1: A_t = sum_k gamma^k r_{t+k}, REINFORCE++'s discounted return, masked tokens handled alike
    adv, ret = gae(REWARDS, SEQ, values=torch.zeros(5), kl=KL, kl_coef=0.1, gamma=0.9, lambd=1.0, loss_mask=MASK)
    rpp = reinforce_plus_plus(REWARDS, SEQ, kl=KL, kl_coef=0.1, gamma=0.9, loss_mask=MASK)
    torch.testing.assert_close(adv, rpp, rtol=0, atol=1e-6)  # the same few fp32 sums, grouped differently
    torch.testing.assert_close(_whiten(ret, MASK), rpp, rtol=0, atol=1e-6)  # returns are the raw advantages (V = 0)


def test_gae_with_lambda_zero_is_the_one_step_td_error():
    seq, v = torch.tensor([0, 0, 0]), torch.tensor([0.3, -0.2, 0.6])
    _, ret = gae(torch.tensor([2.0]), seq, values=v, gamma=0.5, lambd=0.0)
    # R_t = A_t + V_t = r_t + gamma * V_{t+1}: [0 + 0.5 * -0.2, 0 + 0.5 * 0.6, 2.0 + 0]
    torch.testing.assert_close(ret, torch.tensor([-0.1, 0.3, 2.0]), rtol=0, atol=1e-7)


def test_value_loss_clip_by_hand_and_its_gradient():
    v = torch.tensor([1.0, 0.0, 2.0], requires_grad=True)
    old, ret = torch.tensor([0.5, 0.5, 2.0]), torch.tensor([2.0, 1.0, 0.0])
    loss, clipped = value_loss(v, old, ret, value_clip=0.2)
    # t0: (1-2)^2 = 1 vs V_clip = 0.5 + 0.2 = 0.7: (0.7-2)^2 = 1.69, larger -> clipped, 0.5 * 1.69
    # t1: (0-1)^2 = 1 vs V_clip = 0.5 - 0.2 = 0.3: (0.3-1)^2 = 0.49 -> unclipped, 0.5 * 1
    # t2: V == V_old: both 4 -> not clipped (ties count as unclipped), 0.5 * 4
    torch.testing.assert_close(loss, torch.tensor([0.845, 0.5, 2.0]), rtol=0, atol=1e-6)
    assert clipped.tolist() == [True, False, False]
    loss.sum().backward()
    # the clipped token's value is clamped: no gradient; the others: V - R
    torch.testing.assert_close(v.grad, torch.tensor([0.0, -1.0, 2.0]))
    unclipped, none = value_loss(v.detach(), old, ret, value_clip=0.0)  # 0 = off
    torch.testing.assert_close(unclipped, torch.tensor([0.5, 0.5, 2.0]))
    assert not none.any()


def test_critic_loss_uses_the_global_token_denominator_and_skips_masked_tokens():
    v = torch.tensor([1.0, 0.0, 2.0])
    mb = {"loss_mask": torch.tensor([1.0, 1.0, 0.0]), "seq_ids": torch.tensor([0, 0, 1]),
          "old_values": torch.tensor([0.5, 0.5, 2.0]), "returns": torch.tensor([2.0, 1.0, 0.0])}
    loss, m = critic_loss(v, None, mb, CriticSettings(value_clip=0.2), num_tokens=4.0, num_seqs=2.0)
    # (0.845 + 0.5) / 4: the step has 4 loss tokens over all micro-batches, this one holds 2 of them
    assert float(loss) == pytest.approx(1.345 / 4, abs=1e-7)
    assert float(m["value_loss"]) == pytest.approx(1.345 / 4, abs=1e-7)
    assert float(m["vf_clipfrac"]) == pytest.approx(1 / 4) and float(m["values_mean"]) == pytest.approx(1 / 4)
    seq, _ = critic_loss(v, None, mb, CriticSettings(value_clip=0.2, loss_agg_mode="seq-mean-token-mean"),
                         num_tokens=4.0, num_seqs=2.0)
    assert float(seq) == pytest.approx((1.345 / 2 + 0.0) / 2, abs=1e-7)  # sequence 1 has no loss token


def test_explained_variance_by_hand():
    v, r = torch.tensor([1.0, 2.0, 3.0, 7.0]), torch.tensor([1.0, 2.0, 4.0, -5.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])  # the last token is masked out
    # R - V = [0, 0, 1]: var 1/3 - 1/9 = 2/9; R: var 21/3 - 49/9 = 14/9 -> 1 - 2/14 = 6/7
    assert explained_variance(v, r, mask) == pytest.approx(6 / 7, abs=1e-12)
    # with `reduce` the statistics are summed over ranks: two equal ranks give the same value
    assert explained_variance(v, r, mask, reduce=lambda xs: [2 * x for x in xs]) == pytest.approx(6 / 7, abs=1e-12)
    assert explained_variance(r, r, mask) == pytest.approx(1.0)


def test_explained_variance_is_zero_when_the_returns_do_not_vary():
    mask = torch.ones(5)
    # a fresh zero head on a step where every reward is 0: V = R = 0 (the first step of many PPO runs)
    assert explained_variance(torch.zeros(5), torch.zeros(5), mask) == 0.0
    # equal returns that are not 0 and a critic that is off: Var(R) is exactly 0 (two-pass statistics; the one-pass
    # sum(R^2)/n - mean^2 leaves +-1e-17 for 1000 returns of 0.1, which gave a value of order -1e16), so 0.0
    r, v = torch.full((1000,), 0.1), torch.linspace(-1.0, 1.0, 1000)
    assert explained_variance(v, r, torch.ones(1000)) == 0.0
    assert explained_variance(v, r, torch.ones(1000), reduce=lambda xs: [3 * x for x in xs]) == 0.0  # 3 equal ranks
    r, v = torch.full((5,), 0.3), torch.tensor([0.1, -0.2, 0.5, 0.0, 0.3])
    # only the masked tokens count: the varying last return is outside the mask
    assert explained_variance(v, torch.tensor([0.3, 0.3, 0.3, 0.3, 9.0]), torch.tensor([1.0, 1, 1, 1, 0])) == 0.0
    assert explained_variance(v, r, torch.zeros(5)) == 0.0  # no loss token at all
    # any spread in the returns, however small, gives the ordinary value again
    r2 = torch.tensor([0.3, 0.3, 0.3, 0.3, 0.31])
    assert explained_variance(r2, r2, mask) == pytest.approx(1.0, abs=1e-12)
