"""Several FSDP ranks on a vision-language model with uneven image micro-batches, on CPU (gloo, torchrun).

The ranks hold different numbers of samples, images and image tokens: in some micro-batch one rank has images and the
other none (a text-only micro-batch, or the 2-token dummy of a rank with fewer samples). Every vision block is its own
FSDP unit, so each rank must run the vision tower in every forward: a rank without images runs it on a one-token
dummy image whose output joins the log-probs times zero (polyrl.multimodal.idle_vision_term). The 2-rank run's
log-probs, loss, grad norm and every gradient equal a 1-rank run over all the samples.

This file is also the worker, started as N gloo ranks (tests/ranks.py): `tests/test_multimodal_ranks.py MODEL_DIR
OUT.pt [--freeze]`.
"""

from __future__ import annotations

import functools
import os
import random
import subprocess

import pytest
import torch

# Samples 0..4 on rank 0, 5..6 on rank 1 (images per sample; 0 = text only): with --micro-batch-size 2 rank 0 runs
# three micro-batches and rank 1 two, then a dummy, so some forward has images on one rank only
IMAGES = [1, 2, 0, 1, 2, 0, 1]
SPLIT = {0: [0, 1, 2, 3, 4], 1: [5, 6]}
MICRO = 2
ROUND = 1e-5  # fp32 rounding of sums taken in another order (another packing), relative to the largest element


def uneven_batch(proc, seed: int = 0):
    """IMAGES[i] counting boards in sample i's prompt (text-only where 0), prompts of different lengths, random
    responses with +-1 advantages and a fixed rollout log-prob (the PPO ratio is then not 1: the clip engages)."""
    from polyrl.tasks import counting
    from polyrl.types import TrainBatch
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    ids, plens, mms = [], [], []
    fields: dict[str, list] = {"loss_mask": [], "advantages": [], "rollout_logprobs": []}
    for i, k in enumerate(IMAGES):
        text = "x" * (i % 3) + "how many?"
        if k:
            msg = [{"role": "user", "content": [{"type": "image"}] * k + [{"type": "text", "text": text}]}]
            p, mm = proc.encode(msg, [counting.draw_board(counting.make_board(rng)[0]) for _ in range(k)])
        else:
            p, mm = proc.tokenizer(text, add_special_tokens=False)["input_ids"], None
        r = 2 + (i * 3) % 4
        ids.append(torch.tensor(p + torch.randint(2, 30, (r,), generator=g).tolist()))
        plens.append(len(p))
        mms.append(mm)
        fields["loss_mask"].append(torch.ones(r))
        fields["advantages"].append(torch.full((r,), 1.0 if i % 2 else -1.0))
        fields["rollout_logprobs"].append(torch.full((r,), -3.0))
    return TrainBatch(ids, plens, fields, multimodal=mms)


def worker() -> None:
    import argparse

    import torch.distributed as dist

    from polyrl.algorithms.losses import LossSettings, rl_loss
    from polyrl.backends.fsdp.backend import FSDPBackend
    from polyrl.config import BatchConfig, ModelConfig, OptimizerConfig
    from polyrl.dist import init_distributed
    from polyrl.multimodal import VisionProcessor

    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--freeze", action="store_true")
    a = ap.parse_args()
    init_distributed("cpu")
    torch.set_num_threads(1)
    ws, rk = dist.get_world_size(), dist.get_rank()
    be = FSDPBackend(ModelConfig(hf_checkpoint=a.model, freeze_vision_tower=a.freeze),
                     OptimizerConfig(lr=1e-2, clip_grad=1.0), BatchConfig(micro_batch_size=MICRO), device="cpu")
    batch = uneven_batch(VisionProcessor.from_pretrained(a.model))
    idx = list(range(len(batch))) if ws == 1 else SPLIT[rk]
    mine = batch.select(idx)
    # which rank has images in which forward (the plan is a collective: every rank asks)
    has_images = [any(mine.multimodal[i] is not None for i in p) for p in be._micro_batches(mine)]
    logp = be.compute_logprobs(mine, temperature=0.7)
    names = {p: n for n, p in be.model.lm.named_parameters()}
    grads: list[dict] = []

    def record_grads(opt, args, kwargs):  # every rank (full_tensor is a collective), just before Adam
        full = lambda g: g.full_tensor() if hasattr(g, "full_tensor") else g  # noqa: E731
        grads.append({names[p]: full(p.grad).float().cpu().clone() for group in opt.param_groups
                      for p in group["params"] if p.grad is not None})

    be.optimizer.register_step_pre_hook(record_grads)
    loss_fn = functools.partial(rl_loss, s=LossSettings(eps_clip=0.2, loss_agg_mode="token-mean"))
    m = be.train_step(mine, loss_fn)
    weights = {n: t.float().cpu().clone() for n, t in be.export_weights()}
    gathered: list = [None] * ws
    dist.all_gather_object(gathered, (idx, logp, has_images))
    if rk == 0:
        order = {i: lp for ix, lps, _ in gathered for i, lp in zip(ix, lps)}
        torch.save({"logprobs": [order[i] for i in range(len(batch))], "loss": m["loss"], "grad_norm": m["grad_norm"],
                    "grads": grads[0], "weights": weights, "has_images": [h for _, _, h in gathered]}, a.out)
    dist.barrier()  # no rank tears gloo down while another still has traffic in flight
    dist.destroy_process_group()


def run_worker_ranks(model: str, out: str, nproc: int, *args: str, timeout: float = 240) -> dict:
    """The worker as `nproc` ranks; a rank that waits on a collective the other never issues shows up as the timeout
    (or as gloo's size-mismatch abort)."""
    from ranks import run_ranks
    argv = [__file__, model, out, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")])}

    def once():
        try:
            res = run_ranks(argv, nproc, env, timeout)
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"{nproc}-rank run of {os.path.basename(__file__)} did not finish in {timeout} s "
                                 f"(a rank waiting on a collective?): {(e.stderr or '')[-3000:]}") from None
        return res.returncode, res.stderr
    rc, err = once()
    if rc != 0 and "terminate called without an active exception" in err:
        # gloo's teardown on a loaded 2-core machine occasionally aborts a rank at exit, after the work is done
        # (tests/backends/test_fsdp_equivalence.py); one retry tells that apart from a real failure, which repeats
        rc, err = once()
    assert rc == 0, err[-3000:]
    return torch.load(out)


_MODELS: dict[str, str] = {}


def vl_model(arch: str, tmp_path_factory) -> str:
    from polyrl.tasks import counting
    if arch not in _MODELS:
        path = tmp_path_factory.mktemp(f"{arch}_ranks")
        counting.build_model(str(path), arch=arch)
        _MODELS[arch] = str(path)
    return _MODELS[arch]


# Qwen3-VL's deepstack mergers (in the root FSDP unit) must get their zero gradients on the rank without images too
@pytest.mark.slow
@pytest.mark.parametrize("arch,freeze", [("qwen2_5_vl", False), ("qwen2_5_vl", True), ("qwen3_vl", False)],
                         ids=["qwen2_5_vl-vision-trained", "qwen2_5_vl-vision-frozen", "qwen3_vl-vision-trained"])
def test_two_ranks_with_uneven_images_equal_one_rank(tmp_path_factory, tmp_path, arch, freeze):
    """Log-probs within 1e-5 (fp32; the micro-batches pack other samples together, so attention and the vision
    tower's sums run in another order, as packed vs unpacked do); loss, grad norm and each gradient element within
    ROUND relative to the largest (the 2-rank step adds two ranks' partial sums, ~100 fp32 ulps through two layers
    where a lost or doubled micro-batch is off by O(1)). One step of Adam from the same start moves each weight by at
    most lr (|m/sqrt(v)| <= 1 at step 1), so the weights are within 2 * lr of each other; the vision tower's weights,
    frozen, are equal."""
    model = vl_model(arch, tmp_path_factory)
    args = ("--freeze",) if freeze else ()
    one = run_worker_ranks(model, str(tmp_path / "one.pt"), 1, *args)
    two = run_worker_ranks(model, str(tmp_path / "two.pt"), 2, *args)
    # the case under test happened: a forward with images on one rank and none on the other
    assert any(a != b for a, b in zip(*two["has_images"])), two["has_images"]
    for a, b in zip(one["logprobs"], two["logprobs"]):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    assert one["grad_norm"] > 0
    assert (two["loss"], two["grad_norm"]) == pytest.approx((one["loss"], one["grad_norm"]), rel=ROUND, abs=1e-7)
    assert one["grads"].keys() == two["grads"].keys()
    vision = {k for k in one["weights"] if k.startswith("model.visual.")}
    assert vision and (vision.isdisjoint(one["grads"]) if freeze else vision <= one["grads"].keys())
    for k, g in one["grads"].items():
        torch.testing.assert_close(two["grads"][k], g, rtol=ROUND, atol=ROUND * float(g.abs().max()), msg=lambda m: f"{k}: {m}")
    for k, w in one["weights"].items():
        bound = 0.0 if freeze and k in vision else 2 * 1e-2 * (1 + 1e-5)
        assert float((two["weights"][k] - w).abs().max()) <= bound, k


if __name__ == "__main__":
    worker()
