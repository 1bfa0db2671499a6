"""--true-on-policy's fixed-block linear (polyrl.backends.true_on_policy): a pack of B blocks of ROWS rows through one
GEMM launch per block against batched launches of several blocks (BlockBatches), for each Linear of a model shape.
Per weight: which batch counts gave other bits than one block alone (those the mode refuses), the host time of a
call (what bounded the mode's training forward) and its device time, against one whole GEMM over the pack (the
default mode's arithmetic, not batch-invariant).

    python3 bench/probes/block_gemm.py --shape qwen2.5-0.5b --blocks 19
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--blocks", type=int, default=19, help="blocks in the pack (19 x 2048 rows: the 0.5B GRPO step)")
    p.add_argument("--max-count", type=int, default=32, help="batch counts 1..this are checked against one block")
    p.add_argument("--cap", type=int, default=None, help="blocks per launch at most (default: BlockBatches')")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when there is one")
    p.add_argument("--rows", type=int, default=None, help="rows per block (default: the mode's for the device)")
    return p.parse_args(argv)


def linears(shape: str) -> dict[str, tuple[int, int, bool]]:
    """name -> (out features, in features, bias) of a decoder layer's Linear layers (Qwen2: q/k/v have biases)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/common.py
    from common import QWEN_SHAPES
    c = QWEN_SHAPES[shape]
    h, i = c["hidden_size"], c["intermediate_size"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    return {"q_proj": (h, h, True), "k_proj": (kv, h, True), "o_proj": (h, h, False), "gate_proj": (i, h, False),
            "down_proj": (h, i, False)}


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch

    from polyrl.backends.true_on_policy import ROWS, BlockBatches
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = a.rows or ROWS[device.type]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(fn) -> tuple[float, float]:
        """(median host seconds of a call, median seconds from the first launch to the end of its work)."""
        host, dev = [], []
        for _ in range(a.repeats + 2):
            sync()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            sync()
            host.append(t1 - t0)
            dev.append(time.perf_counter() - t0)
        return statistics.median(host[2:]), statistics.median(dev[2:])

    print(f"{a.shape}, {a.blocks} blocks of {rows} rows, {dtype}, {device}")
    print("| linear | [N, K] | counts with other bits | per-block host ms | per-block wall ms | batched host ms | "
          "batched wall ms | one GEMM wall ms |\n|---|---|---|---|---|---|---|---|")
    g = torch.Generator(device).manual_seed(0)
    for name, (n, k, has_bias) in linears(a.shape).items():
        w = torch.randn(n, k, device=device, dtype=dtype, generator=g) * k ** -0.5
        b = torch.randn(n, device=device, dtype=dtype, generator=g) if has_bias else None
        bb = BlockBatches(cap=a.max_count, check_bytes=1 << 40)
        key = (tuple(w.shape), tuple(w.stride()), w.dtype, b is not None, w.device)
        refused = [c for c in range(2, a.max_count + 1) if not bb._usable(key, c, w, b, rows)]
        x = torch.randn(a.blocks * rows, k, device=device, dtype=dtype, generator=g)
        out = x.new_empty(a.blocks * rows, n)
        per_block = BlockBatches(cap=1)
        batched = BlockBatches(cap=a.cap) if a.cap else BlockBatches()
        batched.run(x, w, b, out, rows)  # its counts checked outside the timing
        pb = timed(lambda: per_block.run(x, w, b, out, rows))
        bt = timed(lambda: batched.run(x, w, b, out, rows))
        whole = timed(lambda: torch.nn.functional.linear(x, w, b))
        print(f"| {name} | [{n}, {k}] | {refused or 'none'} | {pb[0] * 1e3:.3f} | {pb[1] * 1e3:.3f} | "
              f"{bt[0] * 1e3:.3f} | {bt[1] * 1e3:.3f} | {whole[1] * 1e3:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
