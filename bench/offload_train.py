"""`--offload-train` of the FSDP backend: how long the trainer takes to leave the GPU (params and AdamW moments to
the host, `backend.offload()`) and to come back (`backend.onload()`), against a pageable blocking copy of the same
parameters (what `model.to("cpu")` did before offload used pinned memory).

For each model shape (random weights from a config) builds the FSDP backend as `polyrl train --offload-train` does,
runs one train step on a synthetic batch (so the AdamW moments exist), then times offload / onload pairs.

  python bench/offload_train.py --device cuda --model-shapes qwen2.5-0.5b,qwen2.5-1.5b
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SHAPES, build_model_dir, fmt, markdown_table, median, write_json  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/offload_train.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda",), default="cuda", help="offload exists only on CUDA")
    p.add_argument("--model-shapes", default="qwen2.5-0.5b,qwen2.5-1.5b", help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--repeats", type=int, default=3, help="timed offload/onload pairs (median reported)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens of the one train step that creates the moments")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    a = p.parse_args(argv)
    a.shapes = [s.strip() for s in a.model_shapes.split(",") if s.strip()]
    bad = [s for s in a.shapes if s not in SHAPES]
    if bad:
        p.error(f"--model-shapes: unknown {', '.join(bad)}; choose from {', '.join(SHAPES)}")
    return a


def bench_shape(shape: str, a: argparse.Namespace, work: str) -> dict:
    import torch

    from polyrl.algorithms.losses import LossSettings, rl_loss
    from polyrl.backends.fsdp.backend import FSDPBackend
    from polyrl.dist import init_distributed
    from polyrl.config import BatchConfig, ModelConfig, OptimizerConfig

    model_dir = os.path.join(work, shape)
    with torch.device("cuda"):
        info = build_model_dir(model_dir, shape)
    torch.cuda.empty_cache()
    init_distributed("cuda")
    be = FSDPBackend(ModelConfig(hf_checkpoint=model_dir, offload_train=True, compile=False), OptimizerConfig(lr=1e-6),
                     BatchConfig(use_dynamic_batch_size=True, max_tokens_per_gpu=a.tokens), device="cuda", total_steps=2)
    from train_throughput import synthetic_batch
    from transformers import AutoConfig
    batch, _ = synthetic_batch(a.tokens, 128, 512, AutoConfig.from_pretrained(model_dir).vocab_size, seed=0)
    be.train_step(batch, functools.partial(rl_loss, s=LossSettings()))
    torch.cuda.synchronize()
    param_bytes = sum(p.to_local().numel() * p.element_size() for p in be.model.parameters())
    state_bytes = param_bytes + sum(v.numel() * v.element_size() for st in be.optimizer.state.values()
                                    for v in st.values() if torch.is_tensor(v) and v.numel() > 1)
    off, on, pageable = [], [], []
    for _ in range(a.repeats + 1):  # the first pair allocates the pinned host blocks: not timed
        t = time.perf_counter()
        be.offload()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        be.onload()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        ref = [p.to_local().to("cpu") for p in be.model.parameters()]  # pageable, blocking: the old offload's copy
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        del ref
        off.append(t1 - t)
        on.append(t2 - t1)
        pageable.append(t3 - t2)
    off, on, pageable = off[1:], on[1:], pageable[1:]
    del be
    gc.collect()
    torch.cuda.empty_cache()
    shutil.rmtree(model_dir, ignore_errors=True)
    o, i, pg = median(off), median(on), median(pageable)
    return {"shape": shape, "params": info["params"], "state_gib": state_bytes / 2**30, "offload_s": o, "onload_s": i,
            "offload_gbps": state_bytes / o / 1e9, "onload_gbps": state_bytes / i / 1e9,
            "pageable_params_s": pg, "pageable_gbps": param_bytes / pg / 1e9,
            "device": torch.cuda.get_device_name()}


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    work = tempfile.mkdtemp(prefix="polyrl_offload_")
    try:
        rows = [bench_shape(s, a, work) for s in a.shapes]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(markdown_table(["shape", "params", "params + moments GiB", "offload s", "offload GB/s", "onload s",
                          "onload GB/s", "pageable params-only copy GB/s"],
                         [[r["shape"], f"{r['params'] / 1e6:.1f}M", fmt(r["state_gib"]), fmt(r["offload_s"]),
                           fmt(r["offload_gbps"]), fmt(r["onload_s"]), fmt(r["onload_gbps"]), fmt(r["pageable_gbps"])]
                          for r in rows]))
    if a.out:
        write_json(a.out, {"rows": rows, "command": " ".join(sys.argv)})


if __name__ == "__main__":
    main()
