"""The GPU engine's part of a colocated RL step, piece by piece: generate awake, sleep, the train phase's allocation,
wake (weights), a full weight update, wake (KV cache), generate again (graph capture counted apart).

Random BF16 weights of --shape, ignore-EOS so every sample decodes --new-tokens. `--beside-trainer` (the default) is
how `polyrl train` runs the engine (polyrl.assemble.build_engine: it shares the process's caching allocator, sleeps without a
host copy of the weights); `--own-process` is how `polyrl serve` runs it (memory back to the driver, host copy).

  python bench/engine_cycle.py --shape qwen2.5-0.5b --prompts 16 --n 8 --new-tokens 256
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import build_model_dir, markdown_table  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=40)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("--train-gib", type=float, default=20.0, help="what the simulated train phase allocates and frees")
    p.add_argument("--own-process", action="store_true", help="sleep as an engine server does (empty_cache, host copy)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse_args(argv)
    import torch

    from polyrl.rollout.gpu import GPUEngine
    from polyrl.types import SamplingParams

    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    from polyrl.dist import set_host_threads
    set_host_threads("cuda", 1)  # as polyrl train and serve set them
    mdir = tempfile.mkdtemp(prefix="engine_cycle_")
    build_model_dir(mdir, a.shape, seed=0)
    eng = GPUEngine(mdir, dtype=torch.bfloat16, mem_fraction=0.4, ignore_eos=True, profile=True)
    eng.shares_allocator = not a.own_process
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(20, 151000, (a.prompt_len + i % 7,), generator=g).tolist() for i in range(a.prompts)]
    weights = {k: v.detach().clone() for k, v in eng.model.hf.items()}  # the trainer's copy it pushes after a wake

    def sp(seed):
        return SamplingParams(temperature=1.0, max_new_tokens=a.new_tokens, seed=seed, n=a.n)

    def timed(f):
        torch.cuda.synchronize()
        t = time.perf_counter()
        f()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    for s in range(2):  # kernels compiled, graphs captured
        eng.generate(prompts, sp(s))
    rows: dict[str, list[float]] = {}

    def add(k, v):
        rows.setdefault(k, []).append(v)

    for c in range(a.cycles):
        add("generate, awake", timed(lambda: eng.generate(prompts, sp(c))))
        add("  of which prefill", eng.last_stats["prefill_s"])
    for c in range(a.cycles):
        add("sleep", timed(eng.sleep))

        def train_phase():
            x = torch.empty(int(a.train_gib * 2**30), dtype=torch.uint8, device="cuda")
            x.fill_(1)
            del x
        add("train phase allocation (fill, free)", timed(train_phase))
        add("wake weights", timed(lambda: eng.wake(("weights",))))
        add("full weight update", timed(lambda: eng.update_weights(iter(weights.items()), c + 1)))
        add("wake KV cache", timed(lambda: eng.wake(("kv_cache",))))
        add("generate after wake", timed(lambda: eng.generate(prompts, sp(c))))
        add("  of which graph capture", eng.last_stats["graph_capture_s"])
        add("  of which prefill (after wake)", eng.last_stats["prefill_s"])
    mode = "own process" if a.own_process else "beside the trainer"
    print(f"{a.shape}, {a.prompts} prompts x {a.n} samples x {a.new_tokens} new tokens, {mode}, "
          f"{torch.cuda.get_device_name()}, median of {a.cycles}")
    print(markdown_table(["part", "ms"], [[k, f"{1000 * statistics.median(v):.1f}"] for k, v in rows.items()]))


if __name__ == "__main__":
    main()
