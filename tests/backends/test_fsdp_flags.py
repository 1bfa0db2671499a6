"""The optimizer and memory flags of the FSDP backend, each checked for its effect on CPU (tiny model, FP32 unless said):
--lr-warmup-steps / --lr-decay-style / --min-lr / --lr-decay-steps (the LR each optimizer step applies, against the
formula), --adam-beta1 / --adam-beta2 / --adam-eps / --weight-decay (every weight after each step, against AdamW replayed
by hand on the gradients the step applied), --weight-decay alone (zero gradients: weights shrink by lr * wd), --clip-grad
(the applied gradients' norm), --gradient-checkpointing (same losses and gradients, each decoder layer's body run
twice) and --fp16 (half-precision compute over FP32 weights)."""

from __future__ import annotations

import functools
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from fsdp_worker import fixed_batch  # noqa: E402

from polyrl.algorithms.losses import LossSettings, rl_loss  # noqa: E402

LOSS = functools.partial(rl_loss, s=LossSettings(eps_clip=0.2, loss_agg_mode="token-mean"))


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class Recorded:
    """An FSDPBackend with, per optimizer step, the LR and the gradients it applied (after clipping), by HF name."""

    def __init__(self, model_dir: str, *, total_steps: int = 8, model: dict | None = None, **optim):
        from polyrl.backends.fsdp.backend import FSDPBackend
        from polyrl.dist import init_distributed
        from polyrl.config import BatchConfig, ModelConfig, OptimizerConfig
        init_distributed("cpu")
        self.be = FSDPBackend(ModelConfig(hf_checkpoint=model_dir, **(model or {})),
                              OptimizerConfig(**optim), BatchConfig(micro_batch_size=8), device="cpu",
                              total_steps=total_steps)
        self.names = {p: n for n, p in self.be.model.lm.named_parameters()}  # tied: the first name, as export_weights
        self.lrs: list[float] = []
        self.grads: list[dict[str, torch.Tensor]] = []
        self.be.optimizer.register_step_pre_hook(self._record)

    def _record(self, opt, args, kwargs):  # just before AdamW: the gradients are the clipped ones
        self.lrs.append(opt.param_groups[0]["lr"])
        self.grads.append({self.names[p]: _full(p.grad).double().clone() for g in opt.param_groups for p in g["params"]})

    def weights(self) -> dict[str, torch.Tensor]:
        return {self.names[p]: _full(p).detach().double().clone() for g in self.be.optimizer.param_groups for p in g["params"]}

    def step(self, batch=None, loss_fn=LOSS) -> dict:
        return self.be.train_step(batch if batch is not None else fixed_batch(), loss_fn)


def expected_lr(k: int, *, lr, warmup, style, min_lr, decay_steps, total_steps) -> float:
    """The LR of optimizer step k (0-based), as --help describes the flags: a linear warm-up over --lr-warmup-steps (step
    k at (k + 1) / (warmup + 1) of --lr), then --lr-decay-style from --lr down to --min-lr over --lr-decay-steps (default:
    the rest of the run), then --min-lr."""
    if k < warmup:
        return lr * (k + 1) / (warmup + 1)
    decay = decay_steps or max(total_steps - warmup, 1)
    frac = min((k - warmup) / decay, 1.0)
    if style == "constant":
        return lr
    shape = 1 - frac if style == "linear" else 0.5 * (1 + math.cos(math.pi * frac))
    return min_lr + (lr - min_lr) * shape


@pytest.mark.parametrize("warmup,style,min_lr,decay_steps", [
    (2, "constant", 0.0, None),
    (0, "linear", 1e-3, None),  # decays over the whole run (8 steps)
    (2, "cosine", 2e-3, 3),  # reaches --min-lr at step 5 and stays there
])
def test_lr_schedule_each_step_against_the_formula(tiny_model, warmup, style, min_lr, decay_steps):
    kw = dict(lr=1e-2, warmup=warmup, style=style, min_lr=min_lr, decay_steps=decay_steps, total_steps=8)
    rec = Recorded(tiny_model, total_steps=8, lr=1e-2, lr_warmup_steps=warmup, lr_decay_style=style, min_lr=min_lr,
                   lr_decay_steps=decay_steps)
    logged = [rec.step()["lr"] for _ in range(8)]
    want = [expected_lr(k, **kw) for k in range(8)]
    assert rec.lrs == pytest.approx(want, rel=1e-12), (rec.lrs, want)
    assert logged == rec.lrs  # the metric is the rate the step applied, not the next step's
    assert len(set(round(x, 12) for x in want)) > 2  # the schedule moves in each case (not a constant LR passing)


def test_adamw_betas_eps_and_weight_decay_replayed_by_hand(tiny_model):
    """Three steps; each weight after each step equals torch-free AdamW (float64) applied to the recorded gradients
    with --adam-beta1 0.8 --adam-beta2 0.95 --adam-eps 1e-3 --weight-decay 0.1 and the step's LR. Far-from-default values:
    the defaults (0.9, 0.999, 1e-8, 0) move each weight differently by a sizable fraction of lr (1e-2), while the
    kernel's fp32 rounding is ~1e-7 relative to the weight (one ulp) plus ~1e-6 of lr: rtol 1e-6, atol 1e-8."""
    b1, b2, eps, wd = 0.8, 0.95, 1e-3, 0.1
    rec = Recorded(tiny_model, total_steps=4, lr=1e-2, lr_warmup_steps=1, lr_decay_style="linear",
                   adam_beta1=b1, adam_beta2=b2, adam_eps=eps, weight_decay=wd, clip_grad=0.0)
    w = rec.weights()
    m = {k: torch.zeros_like(v) for k, v in w.items()}
    v = {k: torch.zeros_like(x) for k, x in w.items()}
    moved_by_eps = 0
    for t in range(1, 4):
        rec.step()
        lr, g = rec.lrs[-1], rec.grads[-1]
        got = rec.weights()
        for k in w:
            w[k] = w[k] * (1 - lr * wd)
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            step = (m[k] / (1 - b1 ** t)) / ((v[k] / (1 - b2 ** t)).sqrt() + eps)
            w[k] = w[k] - lr * step
            torch.testing.assert_close(got[k], w[k], rtol=1e-6, atol=1e-8, msg=lambda s: f"step {t} {k}: {s}")
            if t == 1:  # eps 1e-3 against gradients of ~1e-3: the first update is visibly below lr (|g| / (|g| + eps))
                moved_by_eps += int(((step.abs() < 0.9) & (g[k] != 0)).sum())
            w[k] = got[k]  # the next step starts from the weights the backend holds (no drift of rounding)
    assert moved_by_eps > 0


def test_weight_decay_shrinks_weights_by_lr_times_wd_under_zero_gradients(tiny_model):
    """A zero loss gives zero gradients, so Adam's update is 0 and only decoupled weight decay acts:
    w <- w * (1 - lr * wd) exactly (one fp32 multiply: 1 ulp)."""
    zero = lambda logp, ent, mb, **kw: ((logp * 0.0).sum(), {})  # noqa: E731
    for wd in (0.0, 0.5):
        rec = Recorded(tiny_model, lr=1e-2, weight_decay=wd)
        before = rec.weights()
        m = rec.step(loss_fn=zero)
        assert m["grad_norm"] == 0.0 and m["skipped_step"] == 0.0
        after = rec.weights()
        for k in before:
            torch.testing.assert_close(after[k], before[k] * (1 - 1e-2 * wd), rtol=2 ** -23, atol=0)
        if wd:
            assert all(not torch.equal(after[k], before[k]) for k in before if before[k].abs().max() > 0)


@pytest.mark.parametrize("clip", [0.0, 1e-3, 1e6])
def test_clip_grad_bounds_the_applied_gradient_norm(tiny_model, clip):
    """grad_norm is the norm before clipping; the gradients AdamW receives have norm min(grad_norm, --clip-grad)
    (0 turns clipping off). The tiny model's first-step norm is ~1, so 1e-3 clips and 1e6 does not."""
    rec = Recorded(tiny_model, lr=1e-2, clip_grad=clip)
    m = rec.step()
    applied = math.sqrt(sum(float((g ** 2).sum()) for g in rec.grads[0].values()))
    want = m["grad_norm"] if clip == 0 else min(m["grad_norm"], clip)
    assert m["grad_norm"] > 1e-2  # well above the 1e-3 bound: clipping has something to do
    assert applied == pytest.approx(want, rel=1e-5), (applied, m["grad_norm"])  # fp32 sums of ~1e4 squares


def test_gradient_checkpointing_same_losses_and_gradients_and_layers_run_twice(tiny_model):
    """Recomputing activations in the backward runs the same fp32 ops in the same order on CPU: the losses and the
    applied gradients agree to rounding (1e-6), and each decoder layer's body runs twice per train step (once in the
    forward, once recomputed in the backward) where it runs once without the flag."""
    out = {}
    for gc in (False, True):
        rec = Recorded(tiny_model, lr=1e-2, model={"gradient_checkpointing": gc})
        # a pre-hook of a module inside the layer: the checkpoint wraps the layer's forward (the layer's own hooks run
        # once), and its recompute stops early once the saved tensors are back (a post-hook may never run)
        calls = []
        rec.be.model.lm.model.layers[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
        metrics = [rec.step() for _ in range(2)]
        out[gc] = (metrics, rec.grads, len(calls))
    (m0, g0, c0), (m1, g1, c1) = out[False], out[True]
    assert (c0, c1) == (2, 4)  # 2 train steps of one micro-batch each
    for a, b in zip(m0, m1):
        assert (a["loss"], a["grad_norm"]) == pytest.approx((b["loss"], b["grad_norm"]), rel=1e-6)
    for ga, gb in zip(g0, g1):
        for k in ga:
            torch.testing.assert_close(gb[k], ga[k], rtol=1e-6, atol=1e-6 * float(ga[k].abs().max()), msg=k)


def test_fp16_computes_in_half_precision_over_fp32_master_weights(tiny_model):
    """--fp16 on CPU: the forward runs in FP16 (log-probs off FP32's by FP16 rounding, ~8x less than BF16's: 10 mantissa
    bits against 7), while the optimizer steps FP32 weights; a step trains as FP32's does (grad norms within 1%: FP16
    rounds each op to ~1e-3 relative, measured 5e-5 apart)."""
    batch = fixed_batch()
    runs = {name: Recorded(tiny_model, lr=1e-2, model=model)
            for name, model in (("fp32", None), ("fp16", {"fp16": True}), ("bf16", {"bf16": True}))}
    lp = {name: torch.cat(r.be.compute_logprobs(batch)) for name, r in runs.items()}
    err16, err_bf = float((lp["fp16"] - lp["fp32"]).abs().max()), float((lp["bf16"] - lp["fp32"]).abs().max())
    assert 0 < err16 < 1e-2 and err16 * 2 < err_bf, (err16, err_bf)
    assert {p.dtype for g in runs["fp16"].be.optimizer.param_groups for p in g["params"]} == {torch.float32}
    g16, g32 = runs["fp16"].step()["grad_norm"], runs["fp32"].step()["grad_norm"]
    assert g16 == pytest.approx(g32, rel=1e-2)


def test_the_flags_reach_the_config_sections_the_backend_is_built_from():
    """The backend takes cfg.optimizer and cfg.model whole; the flags above must land there under these names."""
    from polyrl.cli import build_parser
    from polyrl.config import config_from_args
    cfg = config_from_args(build_parser().parse_args([
        "train", "--lr", "0.02", "--lr-warmup-steps", "2", "--lr-decay-style", "cosine", "--min-lr", "0.002",
        "--lr-decay-steps", "3", "--adam-beta1", "0.8", "--adam-beta2", "0.95", "--adam-eps", "0.001",
        "--weight-decay", "0.1", "--clip-grad", "0.5", "--gradient-checkpointing"]))
    o = cfg.optimizer
    assert (o.lr, o.lr_warmup_steps, o.lr_decay_style, o.min_lr, o.lr_decay_steps) == (0.02, 2, "cosine", 0.002, 3)
    assert (o.adam_beta1, o.adam_beta2, o.adam_eps, o.weight_decay, o.clip_grad) == (0.8, 0.95, 0.001, 0.1, 0.5)
    assert cfg.model.gradient_checkpointing is True
