"""On-policy distillation (OPD): a frozen teacher scores the student's own samples, token by token.

Same flat layout as advantages.py: ``[T]`` tensors over the concatenated response tokens.
For a sampled token y_t, ``teacher_logprobs[t] = log p_teacher(y_t | prefix)`` and
``student_logprobs[t] = log p_student(y_t | prefix)`` under the policy that sampled it (before the
update). ``teacher - student`` is minus the single-sample estimate of the per-token reverse KL
KL(student || teacher): positive where the teacher likes the token more than the student does. Used as
an advantage, the policy gradient pushes the student towards the teacher on the states it visits itself.
"""

from __future__ import annotations

import torch


def opd_advantages(advantages: torch.Tensor, student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, *,
                   coef: float, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """A_t = advantages_t + coef * (teacher_logprobs_t - student_logprobs_t), and A_t = advantages_t on tokens
    outside the loss mask (e.g. tool output: the student did not sample them).

    advantages: [T] task advantages (any estimator's output); student_logprobs, teacher_logprobs: [T];
    loss_mask: [T] (1 = trained token) or None. -> [T] float32
    """
    gap = teacher_logprobs.float() - student_logprobs.float()
    if loss_mask is not None:
        gap = gap * loss_mask.float()
    return advantages.float() + coef * gap


def opd_sums(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, loss_mask: torch.Tensor) -> list[float]:
    """[sum of (student - teacher), sum of teacher, number of tokens] over the loss-mask tokens, in float64: the
    parts of opd/reverse_kl and opd/teacher_logprob, summed over ranks before dividing."""
    m = loss_mask.bool()
    s, t = student_logprobs.double()[m], teacher_logprobs.double()[m]
    return [float((s - t).sum()), float(t.sum()), float(m.sum())]


def opd_metrics(sums: list[float]) -> dict[str, float]:
    """opd/reverse_kl: mean of student_lp - teacher_lp (the k1 estimate of KL(student || teacher) per token);
    opd/teacher_logprob: mean teacher log-prob of the sampled tokens. sums: opd_sums' output (over all ranks)."""
    kl, t, n = sums
    n = max(n, 1.0)
    return {"opd/reverse_kl": kl / n, "opd/teacher_logprob": t / n}
