"""`--offload-train`: how long the trainer takes to leave the GPU (`backend.offload()`: weights, master weights and
optimizer state to pinned host memory) and to come back (`backend.onload()`), and the round trip's rate (bytes copied
each way x 2 / (offload s + onload s)); for FSDP also against a pageable blocking copy of the same parameters (what
`model.to("cpu")` did before offload used pinned memory).

For each model shape (random weights from a config) and each backend (`fsdp`; `megatron`: DDP with the distributed
optimizer, BF16 weights + FP32 main parameters + Adam; `megatron-fsdp`: `--use-megatron-fsdp`) builds the backend as
`polyrl train --offload-train` does, runs one train step on a synthetic batch (so the optimizer state exists), then
times offload / onload pairs.

  python bench/offload_train.py --device cuda --model-shapes qwen2.5-0.5b,qwen2.5-1.5b --backends fsdp,megatron,megatron-fsdp
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SHAPES, build_model_dir, fmt, markdown_table, median, write_json  # noqa: E402

BACKENDS = ("fsdp", "megatron", "megatron-fsdp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/offload_train.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda",), default="cuda", help="offload exists only on CUDA")
    p.add_argument("--model-shapes", default="qwen2.5-0.5b,qwen2.5-1.5b", help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--backends", default="fsdp,megatron,megatron-fsdp",
                   help="comma list of fsdp, megatron (DDP + distributed optimizer), megatron-fsdp (--use-megatron-fsdp)")
    p.add_argument("--repeats", type=int, default=3, help="timed offload/onload pairs (median reported)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens of the one train step that creates the moments")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    a = p.parse_args(argv)
    a.shapes = [s.strip() for s in a.model_shapes.split(",") if s.strip()]
    bad = [s for s in a.shapes if s not in SHAPES]
    if bad:
        p.error(f"--model-shapes: unknown {', '.join(bad)}; choose from {', '.join(SHAPES)}")
    a.backend_list = [b.strip() for b in a.backends.split(",") if b.strip()]
    bad = [b for b in a.backend_list if b not in BACKENDS]
    if bad:
        p.error(f"--backends: unknown {', '.join(bad)}; choose from {', '.join(BACKENDS)}")
    return a


def _build(backend: str, model_dir: str, tokens: int):
    """The backend as `polyrl train --offload-train` builds it (compile off: no compile time in a memory benchmark)."""
    from polyrl.config import BatchConfig, MegatronConfig, ModelConfig, OptimizerConfig
    mc = ModelConfig(hf_checkpoint=model_dir, offload_train=True, compile=False)
    oc, bc = OptimizerConfig(lr=1e-6), BatchConfig(use_dynamic_batch_size=True, max_tokens_per_gpu=tokens)
    if backend == "fsdp":
        from polyrl.backends.fsdp.backend import FSDPBackend
        return FSDPBackend(mc, oc, bc, device="cuda", total_steps=2)
    from polyrl.backends.megatron.backend import MegatronBackend
    return MegatronBackend(mc, oc, bc, device="cuda", total_steps=2,
                           megatron_cfg=MegatronConfig(use_megatron_fsdp=backend == "megatron-fsdp"))


def _copied_bytes(backend: str, be) -> tuple[int, int]:
    """(bytes each offload copies to the host and back, of which weights): FSDP's FP32 parameters and AdamW moments;
    Megatron's storages the offloader keeps (weights, main parameters, Adam state; Megatron-FSDP also its gradient
    buffer), after one offload."""
    import torch
    if backend == "fsdp":
        params = sum(p.to_local().numel() * p.element_size() for p in be.model.parameters())
        return params + sum(v.numel() * v.element_size() for st in be.optimizer.state.values()
                            for v in st.values() if torch.is_tensor(v) and v.numel() > 1), params
    slots = be._offloader.slots
    return (sum(s.nbytes for s in slots if s.keep), sum(s.nbytes for s in slots if s.keep and s.kind == "weights"))


def bench_backend(backend: str, shape: str, model_dir: str, info: dict, a: argparse.Namespace) -> dict:
    import torch

    from polyrl.algorithms.losses import LossSettings, rl_loss
    from train_throughput import synthetic_batch
    from transformers import AutoConfig

    be = _build(backend, model_dir, a.tokens)
    batch, _ = synthetic_batch(a.tokens, 128, 512, AutoConfig.from_pretrained(model_dir).vocab_size, seed=0)
    be.train_step(batch, functools.partial(rl_loss, s=LossSettings()))
    torch.cuda.synchronize()
    off, on, pageable, mem = [], [], [], {}
    for i in range(a.repeats + 1):  # the first pair allocates the pinned host blocks: not timed
        mem["before"] = torch.cuda.memory_allocated()
        t = time.perf_counter()
        be.offload()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        mem["after"] = torch.cuda.memory_allocated()
        # the whole state: Megatron's onload() leaves the main parameters and Adam moments for its optimizer step
        be.onload() if backend == "fsdp" else be._offloader.onload()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if backend == "fsdp":  # the old offload's copy: pageable, blocking
            ref = [p.to_local().to("cpu") for p in be.model.parameters()]
            torch.cuda.synchronize()
            pageable.append(time.perf_counter() - t2)
            del ref
        off.append(t1 - t)
        on.append(t2 - t1)
    copied, weights = _copied_bytes(backend, be)
    off, on, pageable = off[1:], on[1:], pageable[1:]
    del be
    gc.collect()  # megatron's DDP hooks hold the model in reference cycles
    torch.cuda.empty_cache()
    if hasattr(torch._C, "_host_emptyCache"):  # the pinned blocks of this row, before the next row pins its own
        torch._C._host_emptyCache()
    o, i = median(off), median(on)
    pg = median(pageable) if pageable else None
    return {"shape": shape, "backend": backend, "params": info["params"], "copied_gib": copied / 2**30,
            "offload_s": o, "onload_s": i, "offload_gbps": copied / o / 1e9, "onload_gbps": copied / i / 1e9,
            "round_trip_gbps": 2 * copied / (o + i) / 1e9, "allocated_before_gib": mem["before"] / 2**30,
            "allocated_after_gib": mem["after"] / 2**30, "pageable_params_s": pg,
            "pageable_gbps": weights / pg / 1e9 if pg else None, "device": torch.cuda.get_device_name()}


def bench_shape(shape: str, a: argparse.Namespace, work: str) -> list[dict]:
    import torch

    from polyrl.dist import init_distributed, set_host_threads

    model_dir = os.path.join(work, shape)
    with torch.device("cuda"):
        info = build_model_dir(model_dir, shape)
    torch.cuda.empty_cache()
    init_distributed("cuda")
    set_host_threads("cuda", 1)  # as polyrl train sets them
    rows = []
    try:
        for b in a.backend_list:
            rows.append(bench_backend(b, shape, model_dir, info, a))
            print(json.dumps(rows[-1]), flush=True)  # each row as it is measured
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    work = tempfile.mkdtemp(prefix="polyrl_offload_")
    try:
        rows = [r for s in a.shapes for r in bench_shape(s, a, work)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(markdown_table(["shape", "backend", "params", "copied GiB", "offload s", "offload GB/s", "onload s",
                          "onload GB/s", "round trip GB/s", "GPU GiB before / after offload",
                          "pageable params-only copy GB/s"],
                         [[r["shape"], r["backend"], f"{r['params'] / 1e6:.1f}M", fmt(r["copied_gib"]),
                           fmt(r["offload_s"]), fmt(r["offload_gbps"]), fmt(r["onload_s"]), fmt(r["onload_gbps"]),
                           fmt(r["round_trip_gbps"]),
                           f"{fmt(r['allocated_before_gib'])} / {fmt(r['allocated_after_gib'])}",
                           fmt(r["pageable_gbps"]) if r["pageable_gbps"] else "-"]
                          for r in rows]))
    if a.out:
        write_json(a.out, {"rows": rows, "command": " ".join(sys.argv)})


if __name__ == "__main__":
    main()
