"""Host time of one micro-batch's packing for the Megatron backend (polyrl.backends.megatron.thd.pack_thd, an 8k-token
batch of bench/train_throughput.py's synthetic samples, copied to the device) at each intra-op thread count, alone or
beside a training process. At torch's default of a thread per core, an OpenMP barrier waits for a parked thread when
other threads are busy (bench/RESULTS.md#host-threads-2026-11-28); polyrl.dist.host_threads gives a GPU process one.

    python3 bench/pack_host.py --threads 16 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--threads", type=int, nargs="+", default=[os.cpu_count() or 1, 1])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when there is one")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train_throughput import synthetic_batch

    from polyrl.backends.megatron.thd import pack_thd
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    batch, _ = synthetic_batch(a.tokens, 64, 1024, 151936, seed=0)
    src, idx = torch.arange(a.tokens), torch.randint(0, a.tokens, (a.tokens,))
    print("| threads | pack_thd median ms | pack_thd max ms | one index median us |\n|---|---|---|---|")
    for n in a.threads:
        torch.set_num_threads(n)
        packs, indexes = [], []
        for _ in range(a.repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            pack_thd(batch.input_ids, batch.prompt_lens, device=device)
            packs.append(time.perf_counter() - t)
            t = time.perf_counter()
            src[idx]
            indexes.append(time.perf_counter() - t)
        print(f"| {n} | {statistics.median(packs) * 1e3:.3f} | {max(packs) * 1e3:.3f} | "
              f"{statistics.median(indexes) * 1e6:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
