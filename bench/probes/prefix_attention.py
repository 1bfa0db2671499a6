"""Does a response token's attention output keep its bits when its sequence's queries start after the prompt? The
kernel-level question behind --true-on-policy's scoring of a GRPO group's shared prompt once (docs/true-on-policy.md,
"How"): the trainer's varlen call runs every sequence's queries from its first token; the engine's scorer runs a
sharing sample's response queries only (seqlen_q < seqlen_k, aligned at the bottom right) over the same keys. The
kernel then tiles the queries from another row, so some rows see a fully masked key block first; a FlashAttention-2
style online softmax turns such a block into exact zeros, which leaves the bits unchanged (H200: no row differed).
This script measures it on the GPU's varlen kernel (polyrl.backends.varlen.causal) for random BF16 q / k / v laid out
as a GRPO step: one table row per prompt length, the response rows compared and how many differ.

    python3 bench/probes/prefix_attention.py --heads 14 --kv-heads 2 --head-dim 64
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--samples", type=int, default=8, help="samples per group (sharing one prompt)")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[1, 40, 63, 64, 65, 200])
    p.add_argument("--response", type=int, default=256)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch

    from polyrl.backends import varlen
    if not varlen.available():
        print("prefix_attention: needs a CUDA GPU and torch.nn.attention.varlen", file=sys.stderr)
        return 2
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(dev).manual_seed(0)
    n = a.groups * a.samples
    print("| prompt tokens | response rows compared | rows with other bits | max abs difference |\n|---|---|---|---|")
    for p in a.prompt_lens:
        L = p + a.response
        # each group's prompt keys / values / queries are one tensor shared by its samples (same tokens, same bits)
        shared = [torch.randn(a.groups, p, h, a.head_dim, device=dev, dtype=dt, generator=g)
                  for h in (a.heads, a.kv_heads, a.kv_heads)]
        own = [torch.randn(n, a.response, h, a.head_dim, device=dev, dtype=dt, generator=g)
               for h in (a.heads, a.kv_heads, a.kv_heads)]
        full = [torch.cat([s.repeat_interleave(a.samples, 0), o], 1) for s, o in zip(shared, own)]  # [n, L, h, d]
        q, k, v = (t.reshape(n * L, *t.shape[2:]) for t in full)
        cu = torch.arange(n + 1, device=dev, dtype=torch.int32) * L
        whole = varlen.causal(q, k, v, cu, cu, L, L).view(n, L, a.heads, a.head_dim)[:, p:]
        cu_q = torch.arange(n + 1, device=dev, dtype=torch.int32) * a.response
        tail = varlen.causal(own[0].reshape(n * a.response, a.heads, a.head_dim), k, v, cu_q, cu, a.response, L)
        tail = tail.view(n, a.response, a.heads, a.head_dim)
        differ = (whole != tail).flatten(2).any(-1)
        print(f"| {p} | {n * a.response} | {int(differ.sum())} | {float((whole.float() - tail.float()).abs().max()):.3g} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
