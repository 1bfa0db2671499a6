"""On-policy distillation's advantage and metrics (polyrl/algorithms/distill.py) against values worked by hand."""

from __future__ import annotations

import pytest
import torch

from polyrl.algorithms.distill import opd_advantages, opd_metrics, opd_sums


def test_advantage_adds_coef_times_teacher_minus_student_on_trained_tokens():
    adv = torch.tensor([0.5, 0.5, -1.0, -1.0])
    student = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    teacher = torch.tensor([-0.5, -4.0, -0.5, -1.0])
    mask = torch.tensor([1, 1, 1, 0])
    # gaps t - s: 0.5, -2.0, 0.0, (2.0 masked out); coef 0.5
    out = opd_advantages(adv, student, teacher, coef=0.5, loss_mask=mask)
    assert out.tolist() == [0.75, -0.5, -1.0, -1.0]
    assert opd_advantages(adv, student, teacher, coef=0.5).tolist() == [0.75, -0.5, -1.0, 0.0]  # no mask: every token
    assert opd_advantages(adv, student, teacher, coef=0.0, loss_mask=mask).tolist() == adv.tolist()
    assert out.dtype == torch.float32 and out.shape == (4,)


def test_metrics_are_means_over_loss_mask_tokens_and_sum_over_ranks():
    student = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    teacher = torch.tensor([-0.5, -4.0, -0.5, -1.0])
    mask = torch.tensor([1, 1, 1, 0])
    sums = opd_sums(student, teacher, mask)
    assert sums == [(-0.5) + 2.0 + 0.0, -0.5 - 4.0 - 0.5, 3.0]
    assert opd_metrics(sums) == {"opd/reverse_kl": pytest.approx(0.5), "opd/teacher_logprob": pytest.approx(-5.0 / 3)}
    # two ranks: sums add before the division (a token-weighted mean, not a mean of rank means)
    other = opd_sums(torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([1]))
    total = [a + b for a, b in zip(sums, other)]
    assert opd_metrics(total)["opd/reverse_kl"] == pytest.approx((1.5 + 1.0) / 4)
    assert opd_metrics([0.0, 0.0, 0.0]) == {"opd/reverse_kl": 0.0, "opd/teacher_logprob": 0.0}  # no trained token


def test_teacher_equal_to_student_gives_the_task_advantage():
    lp = torch.randn(7).clamp(max=0)
    adv = torch.randn(7)
    assert torch.equal(opd_advantages(adv, lp, lp.clone(), coef=3.0, loss_mask=torch.ones(7)), adv)
