"""Advantage estimators (polyrl.algorithms.advantages) against values worked out by hand, on CPU."""

import math

import pytest
import torch
from torch.testing import assert_close

from polyrl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    EPS,
    compute_advantages,
    dr_grpo,
    grpo,
    group_baseline,
    gspo,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
)


def seq_ids_for(lens):
    """Flat token -> sequence map for contiguous sequences of the given lengths."""
    return torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))


# 8 sequences, 2 groups of 4; lengths chosen unequal so the broadcast is visible
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
LENS = [2, 1, 3, 1, 1, 1, 2, 1]
SEQ_IDS = seq_ids_for(LENS)  # [0,0,1,2,2,2,3,4,5,6,6,7]

# Group 1 = [1,0,0,1]: mean 0.5, deviations +-0.5,
#   unbiased var = (4 * 0.25) / (4 - 1) = 1/3, std = sqrt(1/3) = 0.5773503
#   adv = +-0.5 / (0.5773503 + 1e-6) = +-0.8660239
# Group 2 = [1,1,1,1]: deviations 0, std 0 -> 0 / (0 + 1e-6) = 0 (no NaN)
A1 = 0.5 / (math.sqrt(1.0 / 3.0) + 1e-6)
GRPO_SEQ = [A1, -A1, -A1, A1, 0.0, 0.0, 0.0, 0.0]
GRPO_TOK = [A1, A1, -A1, -A1, -A1, -A1, A1, 0.0, 0.0, 0.0, 0.0, 0.0]  # per sequence, repeated LENS times


def test_group_baseline_by_hand():
    assert EPS == 1e-6
    assert_close(group_baseline(REWARDS, 4), torch.tensor(GRPO_SEQ))
    assert abs(A1 - 0.8660239) < 1e-6


def test_grpo_broadcasts_over_tokens():
    adv = grpo(REWARDS, SEQ_IDS, group_size=4)
    assert adv.shape == (12,)
    assert_close(adv, torch.tensor(GRPO_TOK))


def test_grpo_without_std_normalisation():
    # mean-centred only: group 1 -> [0.5,-0.5,-0.5,0.5], group 2 -> 0
    adv = grpo(REWARDS, SEQ_IDS, group_size=4, normalize_std=False)
    expect = [0.5, 0.5, -0.5, -0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, 0]
    assert_close(adv, torch.tensor(expect, dtype=torch.float32))


def test_all_equal_group_gives_zero_not_nan():
    r = torch.tensor([3.0, 3.0, 3.0, 0.0, 0.0, 0.0])
    for normalize in (True, False):
        adv = grpo(r, seq_ids_for([1, 2, 1, 1, 1, 3]), group_size=3, normalize_std=normalize)
        assert torch.isfinite(adv).all()
        assert_close(adv, torch.zeros(9))


def test_grpo_group_size_one_is_zero():
    # a group of one: r - mean = 0, std not applied (it would be NaN for n=1)
    adv = grpo(torch.tensor([1.0, 5.0]), seq_ids_for([2, 1]), group_size=1)
    assert_close(adv, torch.zeros(3))


def test_grpo_larger_group_by_hand():
    # [0, 1, 2] : mean 1, deviations [-1,0,1], unbiased var = 2/2 = 1, std 1 -> adv = dev / (1 + 1e-6)
    adv = grpo(torch.tensor([0.0, 1.0, 2.0]), seq_ids_for([1, 1, 1]), group_size=3)
    assert_close(adv, torch.tensor([-1.0, 0.0, 1.0]) / (1 + 1e-6))


def test_dr_grpo_is_mean_centred_only():
    expect = torch.tensor([0.5, 0.5, -0.5, -0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, 0])
    assert_close(dr_grpo(REWARDS, SEQ_IDS, group_size=4), expect)
    # the loop always passes normalize_std; Dr.GRPO must ignore it
    assert_close(dr_grpo(REWARDS, SEQ_IDS, group_size=4, normalize_std=True), expect)
    assert_close(compute_advantages("dr_grpo", REWARDS, SEQ_IDS, group_size=4, normalize_std=True), expect)


def test_gspo_advantages_equal_grpo():
    for normalize in (True, False):
        assert_close(gspo(REWARDS, SEQ_IDS, group_size=4, normalize_std=normalize),
                     grpo(REWARDS, SEQ_IDS, group_size=4, normalize_std=normalize))


def test_group_size_must_divide_rewards():
    with pytest.raises(ValueError, match="groups of 3"):
        grpo(torch.ones(4), seq_ids_for([1, 1, 1, 1]), group_size=3)


# ---- REINFORCE++ ----

def test_reinforce_pp_gamma_half_by_hand():
    # two sequences, lengths 3 and 2; rewards [1, 2]; kl_coef 0.5; gamma 0.5
    seq_ids = seq_ids_for([3, 2])
    kl = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5])
    # token rewards = -0.5 * kl = [-0.05, -0.10, -0.15, -0.20, -0.25]
    #   + sequence reward on each last token: t2: -0.15 + 1 = 0.85, t4: -0.25 + 2 = 1.75
    #   -> [-0.05, -0.10, 0.85, -0.20, 1.75]
    # returns (reset at each sequence boundary):
    #   seq0: G2 = 0.85; G1 = -0.10 + 0.5*0.85 = 0.325; G0 = -0.05 + 0.5*0.325 = 0.1125
    #   seq1: G4 = 1.75; G3 = -0.20 + 0.5*1.75 = 0.675
    returns = [0.1125, 0.325, 0.85, 0.675, 1.75]
    # whitening: mean = 3.7125 / 5 = 0.7425
    #   deviations = [-0.63, -0.4175, 0.1075, -0.0675, 1.0075]
    #   squares sum = 0.3969 + 0.17430625 + 0.01155625 + 0.00455625 + 1.01505625 = 1.602375
    #   unbiased std = sqrt(1.602375 / 4)
    std = math.sqrt(1.602375 / 4)
    expect = torch.tensor([(g - 0.7425) / (std + 1e-6) for g in returns])
    adv = reinforce_plus_plus(torch.tensor([1.0, 2.0]), seq_ids, kl=kl, kl_coef=0.5, gamma=0.5)
    assert_close(adv, expect)
    # the same through compute_advantages, with an all-ones loss mask (whiten over all tokens)
    adv2 = compute_advantages("reinforce_plus_plus", torch.tensor([1.0, 2.0]), seq_ids, group_size=1,
                              kl=kl, kl_coef=0.5, gamma=0.5, loss_mask=torch.ones(5))
    assert_close(adv2, expect)


def test_reinforce_pp_no_kl_gamma_one():
    # no KL, gamma 1: every token's return is its sequence's reward: [1,1,1,2,2]
    # mean = 7/5 = 1.4; deviations [-0.4]*3 + [0.6]*2; squares sum = 3*0.16 + 2*0.36 = 1.2; std = sqrt(1.2/4) = sqrt(0.3)
    adv = reinforce_plus_plus(torch.tensor([1.0, 2.0]), seq_ids_for([3, 2]), kl=torch.ones(5), kl_coef=0.0)
    std = math.sqrt(0.3)
    assert_close(adv, torch.tensor([-0.4, -0.4, -0.4, 0.6, 0.6]) / (std + 1e-6))


def test_reinforce_pp_whitening_uses_masked_tokens_only_and_masked_kl_is_ignored():
    # one sequence of 3 tokens, the middle one an untrained (e.g. tool-output) token: mask [1,0,1]
    # reward 1, kl [0.1, 5.0, 0.3], kl_coef 1, gamma 1
    # token rewards: KL only on trained tokens -> [-0.1, 0, -0.3 + 1] = [-0.1, 0, 0.7]
    # returns: G2 = 0.7, G1 = 0 + 0.7 = 0.7, G0 = -0.1 + 0.7 = 0.6
    # whiten over the masked-in returns [0.6, 0.7]: mean 0.65, unbiased std = sqrt((0.0025 + 0.0025) / 1) = sqrt(0.005)
    std = math.sqrt(0.005)
    adv = reinforce_plus_plus(torch.tensor([1.0]), seq_ids_for([3]), kl=torch.tensor([0.1, 5.0, 0.3]), kl_coef=1.0,
                              gamma=1.0, loss_mask=torch.tensor([1.0, 0.0, 1.0]))
    assert_close(adv, torch.tensor([-0.05, 0.05, 0.05]) / (std + 1e-6))


def test_reinforce_pp_single_token_batch_is_centred_not_nan():
    adv = reinforce_plus_plus(torch.tensor([3.0]), seq_ids_for([1]))
    assert_close(adv, torch.zeros(1))


def test_reinforce_pp_baseline_by_hand():
    # rewards [1,0 | 3,1], group 2: group means 0.5, 2 -> [0.5, -0.5, 1, -1]
    # lens [1,2,1,1] -> tokens [0.5, -0.5, -0.5, 1, -1]
    # mean = (0.5 - 1 + 1 - 1) / 5 = -0.1; deviations [0.6, -0.4, -0.4, 1.1, -0.9]
    # squares sum = 0.36 + 0.16 + 0.16 + 1.21 + 0.81 = 2.7; unbiased std = sqrt(2.7 / 4) = sqrt(0.675)
    std = math.sqrt(0.675)
    adv = reinforce_plus_plus_baseline(torch.tensor([1.0, 0.0, 3.0, 1.0]), seq_ids_for([1, 2, 1, 1]), group_size=2)
    assert_close(adv, torch.tensor([0.6, -0.4, -0.4, 1.1, -0.9]) / (std + 1e-6))
    assert abs(float(adv.mean())) < 1e-6


def test_reinforce_pp_baseline_masked_whitening():
    # same centred tokens [0.5, -0.5, -0.5, 1, -1], mask [1,1,0,1,1]: selected [0.5, -0.5, 1, -1]
    # mean 0; squares sum = 0.25 + 0.25 + 1 + 1 = 2.5; std = sqrt(2.5 / 3)
    std = math.sqrt(2.5 / 3)
    adv = reinforce_plus_plus_baseline(torch.tensor([1.0, 0.0, 3.0, 1.0]), seq_ids_for([1, 2, 1, 1]), group_size=2,
                                       loss_mask=torch.tensor([1, 1, 0, 1, 1]))
    assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 1.0, -1.0]) / (std + 1e-6))


# ---- dispatch ----

def test_registry_names():
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "gspo", "dr_grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"}


def test_compute_advantages_dispatch_grpo():
    assert_close(compute_advantages("grpo", REWARDS, SEQ_IDS, group_size=4, normalize_std=True, kl=None, kl_coef=0.0,
                                    gamma=1.0, loss_mask=torch.ones(12)), torch.tensor(GRPO_TOK))


def test_compute_advantages_unknown_name():
    with pytest.raises(ValueError, match="--advantage-estimator") as e:
        compute_advantages("ppo_gae", REWARDS, SEQ_IDS, group_size=4)
    assert "ppo_gae" in str(e.value) and "grpo" in str(e.value)


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_reinforce_pp_whitening_is_global_across_ranks(name):
    """Two data-parallel shards whitened with summed statistics (what the loop's `reduce` does over
    ranks) give exactly the advantages of the whole batch on one rank."""
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.5, 3.0, 1.0, 0.0, 2.5])
    lens = [3, 2, 4, 1, 2, 5, 3, 2]
    mask = torch.cat([torch.tensor([1.0] * (n - 1) + [1.0 if i % 3 else 0.0]) for i, n in enumerate(lens)])
    kw = dict(group_size=2, kl=torch.linspace(0, 1, sum(lens)), kl_coef=0.1, gamma=0.9)
    whole = compute_advantages(name, rewards, seq_ids_for(lens), loss_mask=mask, **kw)
    halves = [(slice(0, 4), slice(0, sum(lens[:4]))), (slice(4, 8), slice(sum(lens[:4]), sum(lens)))]

    def shard_stats(r, t):  # the statistics each rank would contribute
        adv = compute_advantages(name, rewards[r], seq_ids_for(lens[r]), loss_mask=mask[t],
                                 **dict(kw, kl=kw["kl"][t]), reduce=lambda v: captured.append(v) or v)
        return adv

    captured: list = []
    for r, t in halves:
        shard_stats(r, t)
    total = [sum(c[i] for c in captured) for i in range(3)]
    parts = [compute_advantages(name, rewards[r], seq_ids_for(lens[r]), loss_mask=mask[t], **dict(kw, kl=kw["kl"][t]),
                                reduce=lambda v: total) for r, t in halves]
    assert_close(torch.cat(parts), whole)
    alone = compute_advantages(name, rewards[4:], seq_ids_for(lens[4:]), loss_mask=mask[halves[1][1]],
                               **dict(kw, kl=kw["kl"][halves[1][1]]))
    assert not torch.allclose(alone, whole[halves[1][1]])  # per-rank whitening would differ


def test_reinforce_pp_discount_counts_only_model_tokens():
    # one sequence of 5 tokens: model, model, tool, tool, model (mask [1,1,0,0,1]); reward 1, no KL, gamma 0.5
    # steps are the model tokens only: G4 = 1; the tool tokens pass it on undiscounted: G3 = G2 = 1;
    # G1 = 0 + 0.5 * 1 = 0.5; G0 = 0.5 * 0.5 = 0.25   (counting tool tokens as steps would give G1 = 0.125)
    # whiten over the model tokens [0.25, 0.5, 1]: mean 7/12, unbiased var = sum((g - 7/12)^2) / 2
    returns = [0.25, 0.5, 1.0, 1.0, 1.0]
    mean = 7 / 12
    std = math.sqrt(((0.25 - mean) ** 2 + (0.5 - mean) ** 2 + (1.0 - mean) ** 2) / 2)
    adv = reinforce_plus_plus(torch.tensor([1.0]), seq_ids_for([5]), gamma=0.5,
                              loss_mask=torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0]))
    assert_close(adv, torch.tensor([(g - mean) / (std + 1e-6) for g in returns]))


def test_reinforce_pp_reward_goes_on_the_last_model_token_not_a_trailing_tool_token():
    # sequences [model, model, tool] (reward 1) and [model, model] (reward 0), gamma 0.5:
    # seq0: the reward lands on t1 (the last action): G1 = 1, G0 = 0.5; the trailing tool token gets 0 (masked anyway)
    # seq1: G = [0, 0]. Whiten over the 4 model tokens [0.5, 1, 0, 0]: mean 0.375
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])
    adv = reinforce_plus_plus(torch.tensor([1.0, 0.0]), seq_ids_for([3, 2]), gamma=0.5, loss_mask=mask)
    model = [0.5, 1.0, 0.0, 0.0]
    std = math.sqrt(sum((g - 0.375) ** 2 for g in model) / 3)
    assert_close(adv[mask.bool()], torch.tensor([(g - 0.375) / (std + 1e-6) for g in model]))
