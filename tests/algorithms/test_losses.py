"""Policy losses, KL estimators, TIS and aggregation (polyrl.algorithms.losses) against hand-worked values, on CPU."""

import math

import pytest
import torch
from torch.testing import assert_close

from polyrl.algorithms.losses import (
    AGG_MODES,
    LossSettings,
    aggregate,
    kl_penalty,
    policy_loss,
    rl_loss,
    seq_sum,
    sft_loss,
    tis_weights,
)


def t(*xs, dtype=torch.float64, grad=False):
    return torch.tensor(xs, dtype=dtype, requires_grad=grad)


def seq_ids_for(lens):
    return torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))


# ---- policy_loss: token ratio ----

# ratios 0.5, 1.0, 1.5 with A = +1 and then A = -1; eps_clip 0.2 -> clip range [0.8, 1.2]
RATIOS = [0.5, 1.0, 1.5, 0.5, 1.0, 1.5]
ADVS = [1.0, 1.0, 1.0, -1.0, -1.0, -1.0]
# loss = max(-A*r, -A*clip(r, 0.8, 1.2)); clipped = second term strictly larger
#   A=+1 r=0.5: max(-0.5, -0.8) = -0.5  unclipped (PPO does not clip a worse-than-old positive token)
#   A=+1 r=1.0: max(-1.0, -1.0) = -1.0  unclipped
#   A=+1 r=1.5: max(-1.5, -1.2) = -1.2  clipped
#   A=-1 r=0.5: max( 0.5,  0.8) =  0.8  clipped
#   A=-1 r=1.0: max( 1.0,  1.0) =  1.0  unclipped
#   A=-1 r=1.5: max( 1.5,  1.2) =  1.5  unclipped
TOKEN_LOSS = [-0.5, -1.0, -1.2, 0.8, 1.0, 1.5]
TOKEN_CLIPPED = [False, False, True, True, False, False]
# d loss / d logprob = -A * r where unclipped (d r / d logprob = r), 0 where clipped
TOKEN_GRAD = [-0.5, -1.0, 0.0, 0.0, 1.0, 1.5]


def test_token_ratio_clip_both_sides():
    logprobs = torch.tensor([math.log(r) for r in RATIOS], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(6, dtype=torch.float64)
    loss, clipped, ratio = policy_loss(logprobs, old, torch.tensor(ADVS, dtype=torch.float64), eps_clip=0.2)
    assert_close(ratio.detach(), torch.tensor(RATIOS, dtype=torch.float64))
    assert_close(loss.detach(), torch.tensor(TOKEN_LOSS, dtype=torch.float64))
    assert clipped.tolist() == TOKEN_CLIPPED
    loss.sum().backward()
    assert_close(logprobs.grad, torch.tensor(TOKEN_GRAD, dtype=torch.float64))


def test_ratio_uses_logprob_difference():
    # ratio = exp(logp - old): logp -1, old -1.5 -> exp(0.5) = 1.6487
    _, _, ratio = policy_loss(t(-1.0), t(-1.5), t(0.0), eps_clip=0.2)
    assert_close(ratio, t(math.exp(0.5)))


def test_clip_higher():
    # eps_clip 0.2 (low), eps_clip_high 0.28 -> clip range [0.8, 1.28]
    ratios = [1.25, 1.5, 0.7, 0.7]
    advs = [1.0, 1.0, -1.0, 1.0]
    lp = t(*[math.log(r) for r in ratios])
    loss, clipped, _ = policy_loss(lp, torch.zeros(4, dtype=torch.float64), t(*advs), eps_clip=0.2, eps_clip_high=0.28)
    # A=+1 r=1.25: inside [0.8,1.28] -> -1.25, unclipped (symmetric 0.2 would give -1.2, clipped)
    # A=+1 r=1.5 : max(-1.5, -1.28) = -1.28 clipped
    # A=-1 r=0.7 : max(0.7, 0.8) = 0.8 clipped (low side still 0.2)
    # A=+1 r=0.7 : max(-0.7, -0.8) = -0.7 unclipped
    assert_close(loss, t(-1.25, -1.28, 0.8, -0.7))
    assert clipped.tolist() == [False, True, True, False]
    sym, sym_clipped, _ = policy_loss(lp, torch.zeros(4, dtype=torch.float64), t(*advs), eps_clip=0.2)
    assert_close(sym, t(-1.2, -1.2, 0.8, -0.7))
    assert sym_clipped.tolist() == [True, True, True, False]


def test_dual_clip():
    # c = 3, eps 0.2
    # tok0: A=-2, r=exp(5)=148.41: max(296.83, 2.4) = 296.83 > 3*|A| = 6 -> loss 6, clipped (dual), no gradient
    # tok1: A=-2, r=2:             max(4, 2.4) = 4 < 6 -> 4, unclipped, grad = -A*r = 4
    # tok2: A=+1, r=exp(5):        max(-148.4, -1.2) = -1.2 clipped; dual clip only touches A<0
    # tok3: A=-1, r=0.5:           max(0.5, 0.8) = 0.8 < 3 -> 0.8, clipped (low side)
    lp = t(5.0, math.log(2.0), 5.0, math.log(0.5), grad=True)
    adv = t(-2.0, -2.0, 1.0, -1.0)
    loss, clipped, _ = policy_loss(lp, torch.zeros(4, dtype=torch.float64), adv, eps_clip=0.2, eps_clip_c=3.0)
    assert_close(loss.detach(), t(6.0, 4.0, -1.2, 0.8))
    assert clipped.tolist() == [True, False, True, True]
    loss.sum().backward()
    assert_close(lp.grad, t(0.0, 4.0, 0.0, 0.0))
    # without dual clip the first token is unbounded
    loss_nodual, clipped_nodual, _ = policy_loss(lp.detach(), torch.zeros(4, dtype=torch.float64), adv, eps_clip=0.2)
    assert_close(loss_nodual[0], t(2.0 * math.exp(5.0))[0])
    assert not clipped_nodual[0]


def test_dual_clip_bounds_huge_ratio_to_c_abs_a():
    adv = t(-0.5, -1.0, -4.0)
    loss, clipped, _ = policy_loss(t(30.0, 30.0, 30.0), t(0.0, 0.0, 0.0), adv, eps_clip=0.2, eps_clip_c=3.0)
    assert_close(loss, 3.0 * adv.abs())  # 1.5, 3, 12
    assert clipped.all()


def test_diverged_token_ratio_is_finite():
    # log ratio 200 -> clamped to 20 before exp: ratio = exp(20), not inf
    loss, _, ratio = policy_loss(t(200.0, grad=True), t(0.0), t(-1.0), eps_clip=0.2)
    assert torch.isfinite(ratio).all() and torch.isfinite(loss).all()
    assert_close(ratio.detach(), t(math.exp(20.0)))


# ---- policy_loss: GSPO sequence ratio ----

def gspo_case():
    # seq0: 3 tokens, log ratios [0.05, 0.15, 5.0], the last masked out -> mean over masked tokens = 0.1
    #       s0 = exp(0.1) = 1.1051709, inside [0.8, 1.2]
    # seq1: 1 token, log ratio -0.2 -> s1 = exp(-0.2) = 0.8187308, inside [0.8, 1.2]
    old = t(-1.0, -2.0, -3.0, -1.0)
    lp = (old + t(0.05, 0.15, 5.0, -0.2)).detach().requires_grad_(True)
    seq_ids = torch.tensor([0, 0, 0, 1])
    mask = t(1.0, 1.0, 0.0, 1.0)
    adv = t(1.0, 1.0, 1.0, -1.0)
    return lp, old, adv, seq_ids, mask


def test_gspo_sequence_ratio_value():
    lp, old, adv, seq_ids, mask = gspo_case()
    loss, clipped, ratio = policy_loss(lp, old, adv, eps_clip=0.2, seq_ids=seq_ids, mask=mask, sequence_ratio=True)
    s0, s1 = math.exp(0.1), math.exp(-0.2)
    # every token of a sequence, masked or not, carries the sequence's ratio
    assert_close(ratio.detach(), t(s0, s0, s0, s1))
    # unclipped: loss = -A * s
    assert_close(loss.detach(), t(-s0, -s0, -s0, s1))
    assert not clipped.any()


def test_gspo_gradient_is_sequence_ratio_gradient():
    # GSPO objective per step: J = (1/G) sum_i A_i s_i, s_i = exp((1/|y_i|) sum_{t in y_i} m_t (lp_t - old_t))
    #   d s_i / d lp_t = s_i * m_t / |y_i|, so d(-J)/d lp_t = -A_i * s_i * m_t / (|y_i| * G)
    # policy_loss applies sg[s_i] * pi_t / sg[pi_t] per token (d ratio_t / d lp_t = s_i) and
    # seq-mean-token-mean divides each sequence's token sum by |y_i| and by G: the same gradient.
    lp, old, adv, seq_ids, mask = gspo_case()
    loss, _, _ = policy_loss(lp, old, adv, eps_clip=0.2, seq_ids=seq_ids, mask=mask, sequence_ratio=True)
    aggregate(loss, mask, seq_ids, "seq-mean-token-mean", num_tokens=3, num_seqs=2).backward()
    s0, s1 = math.exp(0.1), math.exp(-0.2)
    # seq0 (|y|=2, A=+1): -1 * 1.1051709 / (2*2) = -0.2762927 on the two trained tokens, 0 on the masked one
    # seq1 (|y|=1, A=-1): +0.8187308 / (1*2) = 0.4093654
    expect = t(-s0 / 4, -s0 / 4, 0.0, s1 / 2)
    assert_close(lp.grad, expect)

    # the same from autograd through the sequence-level objective itself
    lp2 = lp.detach().clone().requires_grad_(True)
    n_tok = seq_sum(mask, seq_ids, 2)
    s = torch.exp(seq_sum((lp2 - old) * mask, seq_ids, 2) / n_tok)
    (-(t(1.0, -1.0) * s).sum() / 2).backward()
    assert_close(lp.grad, lp2.grad)


def test_gspo_clipped_sequence_has_no_gradient():
    # seq1 log ratio -0.5 with A=-1: s1 = 0.6065 < 0.8 -> max(0.6065, 0.8) = 0.8, clipped; gradient 0
    old = t(-1.0, -2.0, -1.0)
    lp = (old + t(0.05, 0.15, -0.5)).detach().requires_grad_(True)
    seq_ids = torch.tensor([0, 0, 1])
    mask = t(1.0, 1.0, 1.0)
    loss, clipped, _ = policy_loss(lp, old, t(1.0, 1.0, -1.0), eps_clip=0.2, seq_ids=seq_ids, mask=mask, sequence_ratio=True)
    assert clipped.tolist() == [False, False, True]
    assert_close(loss.detach()[2], t(0.8)[0])
    loss.sum().backward()
    assert lp.grad[2] == 0.0
    assert_close(lp.grad[:2], t(-math.exp(0.1), -math.exp(0.1)))  # unclipped: d(-A*s0)/d lp_t via sg trick = -A*s0


# ---- KL estimators ----

def test_kl_estimators_by_hand():
    # log ratio lr = logprobs - ref = [-1, 0, 0.5, 2]
    ref = t(-1.0, -2.0, -1.5, -3.0)
    lp = ref + t(-1.0, 0.0, 0.5, 2.0)
    # k1 = lr
    assert_close(kl_penalty(lp, ref, "k1"), t(-1.0, 0.0, 0.5, 2.0), check_dtype=False)
    # k2 = lr^2 / 2 = [0.5, 0, 0.125, 2]
    assert_close(kl_penalty(lp, ref, "k2"), t(0.5, 0.0, 0.125, 2.0), check_dtype=False)
    # k3 = exp(-lr) + lr - 1:
    #   lr=-1 : e - 2            = 0.7182818
    #   lr=0  : 1 + 0 - 1        = 0
    #   lr=0.5: 0.6065307 - 0.5  = 0.1065307
    #   lr=2  : 0.1353353 + 1    = 1.1353353
    k3 = t(0.7182818, 0.0, 0.1065307, 1.1353353)
    assert_close(kl_penalty(lp, ref, "k3"), k3, check_dtype=False, atol=1e-6, rtol=1e-6)
    # low_var_kl equals k3 while inside [-10, 10]
    assert_close(kl_penalty(lp, ref, "low_var_kl"), k3, check_dtype=False, atol=1e-6, rtol=1e-6)
    assert kl_penalty(lp, ref, "k1").dtype == torch.float32  # estimators are computed in fp32


def test_k3_nonnegative():
    g = torch.Generator().manual_seed(0)
    lr = torch.randn(1000, generator=g) * 3
    assert (kl_penalty(lr, torch.zeros(1000), "k3") >= 0).all()
    assert (kl_penalty(lr, torch.zeros(1000), "low_var_kl") >= 0).all()


def test_low_var_kl_clamped_at_10():
    # lr=-5 : exp(5) - 6     = 142.41 -> 10
    # lr=15 : exp(-15) + 14  = 14.0   -> 10
    # lr=-3 : exp(3) - 4     = 16.09  -> 10
    # lr=2  : 1.1353 (unclamped)
    lp = t(-5.0, 15.0, -3.0, 2.0)
    out = kl_penalty(lp, torch.zeros(4), "low_var_kl")
    assert_close(out, torch.tensor([10.0, 10.0, 10.0, math.exp(-2.0) + 1.0]))
    assert kl_penalty(t(-5.0), torch.zeros(1), "k3").item() > 142.0  # k3 is not clamped


def test_low_var_kl_extreme_log_ratio_has_finite_gradient():
    # lr = -100: exp(100) overflows fp32; the value is clamped to 10 and the gradient must be 0, not NaN
    lp = torch.tensor([-100.0, 100.0, 0.5], requires_grad=True)
    out = kl_penalty(lp, torch.zeros(3), "low_var_kl")
    assert_close(out.detach(), torch.tensor([10.0, 10.0, math.exp(-0.5) - 0.5]))
    out.sum().backward()
    # d/dlr (exp(-lr) + lr - 1) = 1 - exp(-lr): 1 - 0.6065307 = 0.3934693 at 0.5; 0 where clamped
    assert_close(lp.grad, torch.tensor([0.0, 0.0, 1.0 - math.exp(-0.5)]))


def test_unknown_kl_type():
    with pytest.raises(ValueError, match="--kl-loss-type"):
        kl_penalty(t(0.0), t(0.0), "k4")


# ---- TIS ----

def test_tis_weights_clamp():
    # exp(old - rollout) = [1, 1.5, 3 -> 2, e^-1]
    old = torch.tensor([0.0, math.log(1.5), math.log(3.0), -1.0], requires_grad=True)
    w = tis_weights(old, torch.zeros(4), clip=2.0)
    assert_close(w, torch.tensor([1.0, 1.5, 2.0, math.exp(-1.0)]))
    assert not w.requires_grad


# ---- aggregation ----

AGG_LOSS = t(1.0, 2.0, 3.0, 4.0, 5.0, 6.0)
AGG_MASK = t(1.0, 1.0, 0.0, 1.0, 1.0, 1.0)
AGG_SEQ = torch.tensor([0, 0, 0, 1, 1, 2])
# masked loss = [1, 2, 0, 4, 5, 6]; per-sequence sums [3, 9, 6]; trained-token counts [2, 2, 1]
AGG_EXPECT = {
    "token-mean": 18 / 5,                            # (1+2+4+5+6) / 5 = 3.6
    "seq-mean-token-mean": (1.5 + 4.5 + 6.0) / 3,    # (3/2 + 9/2 + 6/1) / 3 = 4
    "seq-mean-token-sum": (3 + 9 + 6) / 3,           # 18 / 3 = 6
    "seq-mean-token-sum-norm": 18 / (3 * 4),         # norm_len 4: 18 / 12 = 1.5
}


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_by_hand(mode):
    out = aggregate(AGG_LOSS, AGG_MASK, AGG_SEQ, mode, num_tokens=5, num_seqs=3, norm_len=4.0)
    assert_close(out, t(AGG_EXPECT[mode])[0])


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_split_microbatches_sum_to_whole(mode):
    # micro-batch A = sequences 0,1 (tokens 0..4, local ids [0,0,0,1,1]); B = sequence 2 (token 5, local id [0])
    kw = dict(num_tokens=5, num_seqs=3, norm_len=4.0)
    a = aggregate(AGG_LOSS[:5], AGG_MASK[:5], torch.tensor([0, 0, 0, 1, 1]), mode, **kw)
    b = aggregate(AGG_LOSS[5:], AGG_MASK[5:], torch.tensor([0]), mode, **kw)
    assert_close(a + b, t(AGG_EXPECT[mode])[0])


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_packing_invariance_random(mode):
    # any split into micro-batches (with global denominators) sums to the whole-batch value, and so do gradients
    g = torch.Generator().manual_seed(1)
    lens = [3, 1, 4, 2, 5, 2, 1]
    seq_ids = seq_ids_for(lens)
    T, S = sum(lens), len(lens)
    loss = torch.randn(T, generator=g, dtype=torch.float64).requires_grad_(True)
    mask = (torch.rand(T, generator=g) > 0.3).double()
    kw = dict(num_tokens=float(mask.sum()), num_seqs=float(S), norm_len=7.0)
    whole = aggregate(loss, mask, seq_ids, mode, **kw)
    (gw,) = torch.autograd.grad(whole, loss)
    starts = torch.tensor([0] + list(torch.cumsum(torch.tensor(lens), 0)))
    for cuts in ([3], [1, 5], [2, 4, 6], list(range(1, S))):
        bounds = [0, *cuts, S]
        parts = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            sl = slice(int(starts[lo]), int(starts[hi]))
            parts.append(aggregate(loss[sl], mask[sl], seq_ids[sl] - lo, mode, **kw))
        total = sum(parts)
        assert_close(total, whole)
        (gs,) = torch.autograd.grad(total, loss)
        assert_close(gs, gw)


def test_per_microbatch_mean_would_differ():
    # the bug class the global denominators prevent: averaging per-micro-batch token means
    a = aggregate(AGG_LOSS[:5], AGG_MASK[:5], torch.tensor([0, 0, 0, 1, 1]), "token-mean", num_tokens=4, num_seqs=2)
    b = aggregate(AGG_LOSS[5:], AGG_MASK[5:], torch.tensor([0]), "token-mean", num_tokens=1, num_seqs=1)
    # (12/4 + 6/1) / 2 = 4.5 != 3.6
    assert abs(float((a + b) / 2) - 3.6) > 0.5


def test_aggregate_fully_masked_sequence_contributes_zero():
    # seq0 fully masked: seq-mean-token-mean -> (0 + 5/1) / 2 = 2.5 (count clamped to 1, no NaN)
    out = aggregate(t(1.0, 2.0, 5.0), t(0.0, 0.0, 1.0), torch.tensor([0, 0, 1]), "seq-mean-token-mean", num_tokens=1, num_seqs=2)
    assert_close(out, t(2.5)[0])


def test_aggregate_unknown_mode():
    with pytest.raises(ValueError, match="--loss-agg-mode"):
        aggregate(AGG_LOSS, AGG_MASK, AGG_SEQ, "seq-sum", num_tokens=5, num_seqs=3)


# ---- rl_loss ----

def full_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = [3, 2, 4]
    T = sum(lens)
    lp = -torch.rand(T, generator=g, dtype=torch.float64) * 2
    mb = {
        "seq_ids": seq_ids_for(lens),
        "loss_mask": t(1, 1, 0, 1, 1, 1, 1, 0, 1),
        "advantages": torch.repeat_interleave(t(1.0, -0.5, 2.0), torch.tensor(lens)),
        "old_logprobs": lp + torch.randn(T, generator=g, dtype=torch.float64) * 0.3,
        "ref_logprobs": lp + torch.randn(T, generator=g, dtype=torch.float64) * 0.3,
        "rollout_logprobs": lp + torch.randn(T, generator=g, dtype=torch.float64) * 0.3,
    }
    ent = torch.rand(T, generator=g, dtype=torch.float64) * 3
    return lp, ent, mb, lens


def split_mb(mb, lo_tok, hi_tok, seq_offset):
    out = {k: v[lo_tok:hi_tok] for k, v in mb.items()}
    out["seq_ids"] = out["seq_ids"] - seq_offset
    return out


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("gspo", [False, True])
def test_rl_loss_microbatch_sum_equals_whole(mode, gspo):
    lp, ent, mb, lens = full_batch()
    s = LossSettings(eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=3.0, loss_agg_mode=mode, sequence_ratio=gspo,
                     use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl", entropy_coef=0.01,
                     use_tis=True, tis_clip=2.0, norm_len=8.0)
    num_tokens, num_seqs = float(mb["loss_mask"].sum()), 3.0  # 7 trained tokens
    whole, m_whole = rl_loss(lp, ent, mb, s, num_tokens=num_tokens, num_seqs=num_seqs)
    # micro-batch 1 = sequences 0,1 (tokens 0..4); micro-batch 2 = sequence 2 (tokens 5..8)
    l1, m1 = rl_loss(lp[:5], ent[:5], split_mb(mb, 0, 5, 0), s, num_tokens=num_tokens, num_seqs=num_seqs)
    l2, m2 = rl_loss(lp[5:], ent[5:], split_mb(mb, 5, 9, 2), s, num_tokens=num_tokens, num_seqs=num_seqs)
    assert_close(l1 + l2, whole)
    assert set(m_whole) == {"train_rollout_logprob_abs_diff", "train_rollout_logprob_abs_diff_max", "tis_weight", "pg_loss",
                            "clip_frac", "ratio", "kl", "entropy"}
    for k in m_whole:  # sums over micro-batches, except a *_max metric: the largest of theirs (the backends reduce so)
        got = torch.maximum(m1[k], m2[k]) if k.endswith("_max") else m1[k] + m2[k]
        assert_close(got.double(), m_whole[k].double(), msg=k)


def test_rl_loss_metrics_are_token_means_over_the_global_count():
    lp, ent, mb, _ = full_batch()
    s = LossSettings(use_kl_loss=True, kl_loss_coef=0.0, kl_loss_type="k2")
    _, m = rl_loss(lp, ent, mb, s, num_tokens=7.0, num_seqs=3.0)
    mask = mb["loss_mask"]
    assert_close(m["entropy"].double(), (ent * mask).sum() / 7)
    assert_close(m["kl"].double(), (0.5 * (lp - mb["ref_logprobs"]) ** 2 * mask).sum() / 7)
    assert_close(m["ratio"].double(), (torch.exp(lp - mb["old_logprobs"]) * mask).sum() / 7)


def test_rl_loss_kl_and_entropy_coefficients_by_hand():
    # one sequence of 2 tokens, on-policy (ratio 1), A = [1, 1]: pg = [-1, -1] -> token-mean -1
    # k2 KL: lr = logprobs - ref = [-1 - -1.5, -2 - -1.5] = [0.5, -0.5] -> 0.5*lr^2 = [0.125, 0.125] -> mean 0.125
    # entropy [1, 3] -> mean 2
    # loss = -1 + 0.1 * 0.125 - 0.01 * 2 = -1.0075
    lp = t(-1.0, -2.0, grad=True)
    mb = {"seq_ids": torch.tensor([0, 0]), "loss_mask": t(1.0, 1.0), "advantages": t(1.0, 1.0), "ref_logprobs": t(-1.5, -1.5)}
    s = LossSettings(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k2", entropy_coef=0.01)
    loss, m = rl_loss(lp, t(1.0, 3.0), mb, s, num_tokens=2.0, num_seqs=1.0)
    assert_close(loss.detach(), t(-1.0075)[0])
    assert_close(m["pg_loss"].double(), t(-1.0)[0])
    assert_close(m["kl"].double(), t(0.125)[0])
    assert_close(m["entropy"].double(), t(2.0)[0])
    # d loss / d lp_t = -A_t/2 + 0.1 * lr_t / 2 = [-0.5 + 0.025, -0.5 - 0.025]
    loss.backward()
    assert_close(lp.grad, t(-0.475, -0.525))


def test_rl_loss_entropy_metric_without_bonus():
    lp = t(-1.0, -2.0)
    mb = {"seq_ids": torch.tensor([0, 0]), "loss_mask": t(1.0, 1.0), "advantages": t(1.0, 1.0)}
    loss, m = rl_loss(lp, t(1.0, 3.0), mb, LossSettings(), num_tokens=2.0, num_seqs=1.0)
    assert_close(loss, t(-1.0)[0])  # entropy_coef 0: not in the loss
    assert_close(m["entropy"].double(), t(2.0)[0])
    assert "kl" not in m
    _, m2 = rl_loss(lp, None, mb, LossSettings(), num_tokens=2.0, num_seqs=1.0)
    assert "entropy" not in m2


def test_rl_loss_on_policy_shortcut():
    # no old_logprobs: old = logprobs.detach(), ratio 1, nothing clipped;
    # token-mean gradient = d(sum_t -A_t * r_t * m_t / N) / d lp_t = -A_t * m_t / N with the global N = 10
    lp = t(-0.3, -1.2, -2.0, -0.7, grad=True)
    adv = t(2.0, 2.0, -1.0, 0.5)
    mask = t(1.0, 0.0, 1.0, 1.0)
    mb = {"seq_ids": torch.tensor([0, 0, 1, 2]), "loss_mask": mask, "advantages": adv}
    loss, m = rl_loss(lp, None, mb, LossSettings(eps_clip=0.2), num_tokens=10.0, num_seqs=5.0)
    # loss = -(2 + 0 - 1 + 0.5) / 10 = -0.15
    assert_close(loss.detach(), t(-0.15)[0])
    assert_close(m["ratio"].double(), t(3 / 10)[0])  # three trained tokens with ratio 1, over 10
    assert m["clip_frac"] == 0
    loss.backward()
    assert_close(lp.grad, -adv * mask / 10)


def test_rl_loss_off_policy_clip_frac():
    # old given: ratios [1.5, 1.0] with A=+1, eps 0.2 -> token 0 clipped; clip_frac = 1 / 2
    lp = t(math.log(1.5), 0.0)
    mb = {"seq_ids": torch.tensor([0, 0]), "loss_mask": t(1.0, 1.0), "advantages": t(1.0, 1.0), "old_logprobs": t(0.0, 0.0)}
    loss, m = rl_loss(lp, None, mb, LossSettings(eps_clip=0.2), num_tokens=2.0, num_seqs=1.0)
    assert_close(m["clip_frac"].double(), t(0.5)[0])
    assert_close(m["ratio"].double(), t(1.25)[0])
    assert_close(loss, t((-1.2 - 1.0) / 2)[0])


def test_rl_loss_train_rollout_abs_diff():
    # |lp - rollout| = [0.5, 0, 1 (masked)] -> (0.5 + 0) / num_tokens 2 = 0.25
    mb = {"seq_ids": torch.tensor([0, 0, 0]), "loss_mask": t(1.0, 1.0, 0.0), "advantages": t(0.0, 0.0, 0.0),
          "rollout_logprobs": t(-1.5, -2.0, -2.0)}
    _, m = rl_loss(t(-1.0, -2.0, -3.0), None, mb, LossSettings(), num_tokens=2.0, num_seqs=1.0)
    assert_close(m["train_rollout_logprob_abs_diff"].double(), t(0.25)[0])
    assert "tis_weight" not in m


def test_rl_loss_tis():
    # on-policy, old = lp = [-1, -1]; rollout [-1, -1 - ln 3] -> w = exp(old - rollout) = [1, 3 -> clip 2]
    # pg = -A * 1 * w = [-1, -2] -> token-mean over 2 = -1.5; tis_weight metric (1 + 2) / 2 = 1.5
    lp = t(-1.0, -1.0, grad=True)
    mb = {"seq_ids": torch.tensor([0, 1]), "loss_mask": t(1.0, 1.0), "advantages": t(1.0, 1.0),
          "rollout_logprobs": t(-1.0, -1.0 - math.log(3.0))}
    loss, m = rl_loss(lp, None, mb, LossSettings(use_tis=True, tis_clip=2.0), num_tokens=2.0, num_seqs=2.0)
    assert_close(loss.detach(), t(-1.5)[0])
    assert_close(m["tis_weight"].double(), t(1.5)[0])
    assert_close(m["pg_loss"].double(), t(-1.5)[0])
    loss.backward()
    assert_close(lp.grad, t(-0.5, -1.0))  # -A * w / 2


# ---- SFT ----

def test_sft_loss():
    # -(sum of trained logprobs) / N: -(-2 - 3 - 4) / 6 = 1.5 (token 0 is masked out; global N = 6)
    lp = t(-1.0, -2.0, -3.0, -4.0, grad=True)
    mb = {"loss_mask": t(0.0, 1.0, 1.0, 1.0)}
    loss, m = sft_loss(lp, None, mb, num_tokens=6.0, num_seqs=2.0)
    assert_close(loss.detach(), t(1.5)[0])
    assert_close(m["sft_loss"], t(1.5)[0])
    assert not m["sft_loss"].requires_grad
    loss.backward()
    assert_close(lp.grad, t(0.0, -1 / 6, -1 / 6, -1 / 6))
    # split into two micro-batches with the global count: the sum is unchanged
    a, _ = sft_loss(lp[:2].detach(), None, {"loss_mask": mb["loss_mask"][:2]}, num_tokens=6.0, num_seqs=2.0)
    b, _ = sft_loss(lp[2:].detach(), None, {"loss_mask": mb["loss_mask"][2:]}, LossSettings(), num_tokens=6.0, num_seqs=2.0)
    assert_close(a + b, t(1.5)[0])


# ---- CISPO ----

# same RATIOS/ADVS as above, old logprobs 0 so logprobs = log r; eps 0.2 -> weight w = clip(r, 0.8, 1.2), detached
#   w = [0.8, 1.0, 1.2, 0.8, 1.0, 1.2]; clipped where w != r: [T, F, T, T, F, T]
# loss = -w * A * logp:
#   A=+1 r=0.5: -0.8 * ln 0.5 =  0.5545177     A=-1 r=0.5:  0.8 * ln 0.5 = -0.5545177
#   A=+1 r=1.0: -1.0 * 0      =  0             A=-1 r=1.0:  0
#   A=+1 r=1.5: -1.2 * ln 1.5 = -0.4865581     A=-1 r=1.5:  1.2 * ln 1.5 =  0.4865581
CISPO_LOSS = [0.5545177, 0.0, -0.4865581, -0.5545177, 0.0, 0.4865581]
# d loss / d logp = -w * A (w is a constant): every token has a gradient, the clipped ones too (PPO: 0 at tokens 2, 3)
CISPO_GRAD = [-0.8, -1.0, -1.2, 0.8, 1.0, 1.2]


def test_cispo_values_and_gradient_by_hand():
    from polyrl.algorithms.losses import cispo_loss
    lp = torch.tensor([math.log(r) for r in RATIOS], dtype=torch.float64, requires_grad=True)
    loss, clipped, ratio = cispo_loss(lp, torch.zeros(6, dtype=torch.float64), t(*ADVS), eps_clip=0.2)
    assert_close(ratio, t(*RATIOS))
    assert_close(loss.detach(), t(*CISPO_LOSS), atol=1e-7, rtol=1e-7)
    assert clipped.tolist() == [True, False, True, True, False, True]
    loss.sum().backward()
    assert_close(lp.grad, t(*CISPO_GRAD))
    ppo_grad = torch.tensor(TOKEN_GRAD, dtype=torch.float64)
    assert (ppo_grad[[2, 3]] == 0).all() and (lp.grad[[2, 3]] != 0).all()  # clipped tokens still learn under CISPO


def test_cispo_gradient_is_minus_clipped_ratio_times_advantage_with_clip_higher():
    from polyrl.algorithms.losses import cispo_loss
    # old logprobs -1, -2, -0.5, -3; log ratios ln 1.25, ln 1.5, ln 0.5, ln 0.9; eps 0.2 / high 0.28 -> [0.8, 1.28]
    #   w = [1.25 (inside), 1.28 (clipped high), 0.8 (clipped low), 0.9 (inside)]
    old = t(-1.0, -2.0, -0.5, -3.0)
    lp = (old + t(math.log(1.25), math.log(1.5), math.log(0.5), math.log(0.9))).detach().requires_grad_(True)
    adv = t(2.0, 1.0, -1.0, -0.5)
    loss, clipped, _ = cispo_loss(lp, old, adv, eps_clip=0.2, eps_clip_high=0.28)
    w = t(1.25, 1.28, 0.8, 0.9)
    # loss = -w * A * logp, e.g. token 0: -1.25 * 2 * (-1 + ln 1.25) = 2.5 - 2.5 ln 1.25 = 1.9421320
    assert_close(loss.detach()[0], t(2.5 - 2.5 * math.log(1.25))[0])
    assert_close(loss.detach(), -w * adv * lp.detach())
    assert clipped.tolist() == [False, True, True, False]
    loss.sum().backward()
    assert_close(lp.grad, -w * adv)  # -clip(r) * A * d logp / d logp
    # the diverged-token guard: the ratio saturates at exp(20), the weight at 1 + eps_high
    _, _, ratio = cispo_loss(t(300.0), t(0.0), t(1.0), eps_clip=0.2)
    assert torch.isfinite(ratio).all()


def test_cispo_through_rl_loss_token_mean():
    # rl_loss with --policy-loss cispo: token-mean over num_tokens=4 (global count), mask drops token 3
    #   w = clip([1.5, 0.5, 1.0, 2.0], 0.8, 1.2) = [1.2, 0.8, 1.0, 1.2], A = [1, -1, 1, 1]
    #   grad = -w * A * mask / 4 = [-0.3, 0.2, -0.25, 0]
    old = t(-1.0, -1.0, -1.0, -1.0)
    lp = (old + t(math.log(1.5), math.log(0.5), 0.0, math.log(2.0))).detach().requires_grad_(True)
    mb = {"seq_ids": torch.tensor([0, 0, 1, 1]), "loss_mask": t(1.0, 1.0, 1.0, 0.0), "advantages": t(1.0, -1.0, 1.0, 1.0),
          "old_logprobs": old}
    loss, m = rl_loss(lp, None, mb, LossSettings(policy_loss="cispo"), num_tokens=4, num_seqs=2)
    loss.backward()
    assert_close(lp.grad, t(-0.3, 0.2, -0.25, 0.0))
    assert_close(m["clip_frac"], t(0.5)[0])  # tokens 0 and 1 of 4 (token 3 is masked out)


def test_policy_loss_table_matches_the_config_choices():
    from polyrl.algorithms.losses import POLICY_LOSSES
    from polyrl.config import POLICY_LOSS_TYPES
    assert tuple(POLICY_LOSSES) == POLICY_LOSS_TYPES and POLICY_LOSSES["ppo_clip"] is policy_loss
