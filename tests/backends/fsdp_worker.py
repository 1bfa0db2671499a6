"""Runs FSDPBackend under torchrun (or alone) on a fixed batch, for the equivalence tests.

python -m torch.distributed.run --nproc-per-node N tests/backends/fsdp_worker.py MODEL_DIR OUT.pt
    [--steps K] [--load CKPT] [--save CKPT] [--offload] [--micro-batch-size M] [--dynamic TOKENS] [--lora-rank R]
Writes, from rank 0: losses per step, the full gradients each optimizer step applied (after
clipping), and the full weights before the first and after the last step (with --lora-rank: the
trainable adapter weights, the ones the gradients are of, and the merged export as "merged").
"""

import argparse
import functools
import os

import torch
import torch.distributed as dist

from polyrl.algorithms.losses import LossSettings, rl_loss
from polyrl.dist import init_distributed
from polyrl.checkpoint import load_checkpoint, save_checkpoint
from polyrl.config import BatchConfig, ModelConfig, OptimizerConfig
from polyrl.types import TrainBatch

OPTIM = dict(lr=1e-2, clip_grad=1.0)  # the tests replay AdamW with these settings (and the other defaults)


def fixed_batch(n: int = 8, vocab: int = 14, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids, plens, fields = [], [], {"loss_mask": [], "advantages": [], "rollout_logprobs": []}
    for i in range(n):
        p, r = 3 + i % 4, 2 + (i * 3) % 5
        ids.append(torch.randint(2, vocab, (p + r,), generator=g))
        plens.append(p)
        fields["loss_mask"].append(torch.ones(r))
        fields["advantages"].append(torch.full((r,), 1.0 if i % 2 else -1.0))
        fields["rollout_logprobs"].append(torch.full((r,), -2.5))
    return TrainBatch(ids, plens, fields)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--load")
    ap.add_argument("--save")
    ap.add_argument("--offload", action="store_true")
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--dynamic", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layout", default="auto")
    ap.add_argument("--lora-rank", type=int, default=0)
    a = ap.parse_args()
    init_distributed(a.device)
    torch.set_num_threads(1)
    from polyrl.backends.fsdp.backend import FSDPBackend
    mc = ModelConfig(hf_checkpoint=a.model, fsdp_cpu_offload=a.offload, lora_rank=a.lora_rank)
    oc = OptimizerConfig(**OPTIM)
    bc = BatchConfig(micro_batch_size=a.micro_batch_size, use_dynamic_batch_size=bool(a.dynamic), max_tokens_per_gpu=a.dynamic or None,
                     micro_batch_layout=a.layout)
    be = FSDPBackend(mc, oc, bc, device=a.device, total_steps=8)
    start = load_checkpoint(a.load, be)["step"] if a.load else 0
    batch = fixed_batch()
    ws, rk = dist.get_world_size(), dist.get_rank()
    per = len(batch) // ws
    mine = batch.select(list(range(rk * per, (rk + 1) * per)))
    loss_fn = functools.partial(rl_loss, s=LossSettings(eps_clip=0.2, loss_agg_mode="token-mean"))
    losses, grads = [], []
    names = {p: n for n, p in be.model.lm.named_parameters()}  # tied parameters: their first name, as export_weights

    def record_grads(opt, args, kwargs):  # runs on every rank (full_tensor is a collective), just before Adam
        full = lambda g: g.full_tensor() if hasattr(g, "full_tensor") else g  # noqa: E731
        grads.append({names[p]: full(p.grad).float().cpu().clone() for group in opt.param_groups for p in group["params"]})

    be.optimizer.register_step_pre_hook(record_grads)

    def weights():  # what the optimizer steps: every weight, or the adapters alone
        if not a.lora_rank:
            return {n: t.float().cpu().clone() for n, t in be.export_weights()}
        full = lambda p: p.full_tensor() if hasattr(p, "full_tensor") else p  # noqa: E731
        return {names[p]: full(p).detach().float().cpu().clone() for group in be.optimizer.param_groups for p in group["params"]}

    init = weights()
    for step in range(start, start + a.steps):
        m = be.train_step(mine, loss_fn, with_entropy=True)
        losses.append((m["loss"], m["grad_norm"], m["entropy"]))
    if a.save:
        save_checkpoint(a.save, start + a.steps, be, {"step": start + a.steps})
    final = weights()
    merged = {n: t.float().cpu().clone() for n, t in be.export_weights()} if a.lora_rank else None  # gathered and merged
    if rk == 0:
        torch.save({"losses": losses, "grads": grads, "init": init, "weights": final, "start": start, "merged": merged}, a.out)
    dist.barrier()  # no rank tears gloo down while another still has traffic in flight
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
