"""Qwen3-Next's gated DeltaNet split over tensor-parallel ranks by heads (hf_wrap.tp_gated_deltanet;
CPU, 2 gloo processes, no megatron-core): outputs, the input's gradient and every parameter's
gradient equal the unsplit HF module's in FP32, through HFMixer on a packed batch with the
bridge's TP slices as weights."""

from __future__ import annotations

import datetime
import itertools
import os
import socket
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from polyrl.backends.megatron import bridge, hf_wrap

LENS = [70, 9, 1, 33]  # 70 > the gated delta rule's 64-token chunk
PREFIX = "decoder.layers.0.self_attention."
TP = 2
# The split only regroups sums: out_proj's 64-term dot products become two 32-term partials added
# by the all-reduce (the input gradient likewise), and the narrower projections may take other BLAS
# blockings; each head's own chunked delta rule is the same arithmetic. Those few-ulp differences
# of the projections then pass through the recurrence (a triangular solve per 64-token chunk) and
# parameter gradients sum them over all 113 tokens. FP64 (input perturbations ~1e-16) proves the
# arithmetic is the same function: it agrees to ~1e-15 (measured 8e-16). FP32 (eps 1.2e-7) then
# shows how much the recurrence amplifies ulp-level projection differences: measured up to 4e-5
# relative to each tensor's largest entry (~300 ulp); the bound leaves 5x headroom.
REL_TOL = {torch.float64: 1e-12, torch.float32: 2e-4}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _config():
    from transformers import Qwen3NextConfig
    # 4 key heads / 8 value heads: each rank holds 2 whole key-head groups, each with 2 value heads
    return Qwen3NextConfig(
        vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, layer_types=["linear_attention"], mlp_only_layers=[0],
        rms_norm_eps=1e-6)


def _full_state(cfg) -> dict[str, torch.Tensor]:
    """Every DeltaNet weight random (norm around 1, A_log / dt_bias moved off their init), so a
    misplaced head, channel or column changes the output."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
    torch.manual_seed(0)
    m = Qwen3NextGatedDeltaNet(cfg, 0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name in ("A_log", "dt_bias"):
                p.add_(0.3 * torch.randn_like(p))
            elif name == "norm.weight":
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(std=1.0 / p[0].numel() ** 0.5)
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _mixer(cfg, state: dict, tp_group) -> hf_wrap.HFMixer:
    mcfg = SimpleNamespace(context_parallel_size=1, sequence_parallel=False,
                           tensor_model_parallel_size=1 if tp_group is None else dist.get_world_size(tp_group))
    m = hf_wrap.HFMixer(mcfg, 1, hf_config=hf_wrap.mixer_config(cfg), factory=hf_wrap.MIXERS["qwen3_next"],
                        pg_collection=SimpleNamespace(tp=tp_group))
    m.load_state_dict({k[len(PREFIX):]: v for k, v in state.items()}, strict=True)
    return m


def _run(m: hf_wrap.HFMixer, x: torch.Tensor, gy: torch.Tensor):
    x = x.clone().requires_grad_(True)
    cu = torch.tensor([0] + LENS).cumsum(0).to(torch.int32)
    out, _ = m(x[:, None], packed_seq_params=SimpleNamespace(cu_seqlens_q=cu))
    (out[:, 0] * gy).sum().backward()
    return out[:, 0].detach(), x.grad, {f"{PREFIX}hf.{n}": p.grad for n, p in m.hf.named_parameters()}


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=TP, timeout=datetime.timedelta(seconds=60))
    try:
        for dtype in REL_TOL:
            torch.set_default_dtype(dtype)  # modules, weights and inputs in this dtype
            _compare(rank, os.path.join(out_dir, f"rank{rank}_{str(dtype)[6:]}.pt"))
        dist.barrier()  # no rank tears gloo down while another still has traffic in flight
    finally:
        dist.destroy_process_group()
    # no interpreter finalization (as polyrl.cli.cli): a gloo worker thread still dropping a finished collective's
    # tensors would take the GIL from a finalizing interpreter and abort this rank (exit -6, seen under load)
    os._exit(0)


def _compare(rank: int, path: str) -> None:
    """This rank's split DeltaNet vs the whole module (both run here), saved for the test to check."""
    cfg = _config()
    full = {PREFIX + "hf." + k: v for k, v in _full_state(cfg).items()}
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(LENS), cfg.hidden_size, generator=g)
    gy = torch.randn(sum(LENS), cfg.hidden_size, generator=g)

    ref_out, ref_dx, ref_grads = _run(_mixer(cfg, full, None), x, gy)
    local = {k: bridge.shard_for_tp(k, v, rank, TP, cfg) for k, v in full.items()}
    tp_mixer = _mixer(cfg, local, dist.group.WORLD)
    out, dx, grads = _run(tp_mixer, x, gy)
    shapes = {n: tuple(p.shape) for n, p in tp_mixer.hf.named_parameters()}
    attrs = {n: (getattr(p, "tensor_model_parallel", False), getattr(p, "partition_dim", None))
             for n, p in tp_mixer.hf.named_parameters()}
    # every rank's gradient slices, joined as the backend's export joins weights
    joined = {}
    for k, gr in grads.items():
        parts = [torch.empty_like(gr) for _ in range(TP)]
        dist.all_gather(parts, gr.contiguous())
        joined[k] = bridge.gather_from_tp(k, parts, cfg)
    torch.save(dict(out=out, dx=dx, grads=grads, joined=joined, shapes=shapes, attrs=attrs, ref_out=ref_out,
                    ref_dx=ref_dx, ref_grads=ref_grads, local_ref_grads={k: bridge.shard_for_tp(k, v, rank, TP, cfg)
                                                                        for k, v in ref_grads.items()}),
               path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_head_sharded_gated_deltanet_equals_unsplit_module(tmp_path):
    ctx = mp.start_processes(_worker, args=(_free_port(), str(tmp_path)), nprocs=TP, join=False, start_method="spawn")
    deadline = time.monotonic() + 240  # two spawned interpreters importing transformers on loaded cores
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError("gloo TP workers (test_gdn_tp_cpu._worker) did not finish within 240 s")
    cfg = _config()
    for rank, dtype in itertools.product(range(TP), REL_TOL):
        r = torch.load(tmp_path / f"rank{rank}_{str(dtype)[6:]}.pt")
        assert r["out"].dtype == dtype
        errs = {"out": _rel(r["out"], r["ref_out"]),  # the all-reduced output, on every rank
                "dx": _rel(r["dx"], r["ref_dx"])}  # the input gradient, summed over the ranks' heads
        for k, ref in r["ref_grads"].items():
            errs[k] = _rel(r["grads"][k], r["local_ref_grads"][k])  # this rank's slice of each gradient
            errs["joined " + k] = _rel(r["joined"][k], ref)  # all ranks' slices joined == the full gradient
        assert max(errs.values()) <= REL_TOL[dtype], (dtype, errs)
        # each rank holds nk/tp key heads: a quarter... of every split tensor, the norm whole
        s = r["shapes"]
        assert s["in_proj_qkvz.weight"][0] == (2 * 8 + 2 * 8 * 2) * cfg.linear_num_key_heads // TP
        assert s["conv1d.weight"][0] == (2 * 4 * 8 + 8 * 8) // TP and s["A_log"] == (8 // TP,)
        assert s["out_proj.weight"] == (cfg.hidden_size, 8 * 8 // TP) and s["norm.weight"] == (8,)
        assert r["attrs"]["out_proj.weight"] == (True, 1) and r["attrs"]["in_proj_qkvz.weight"] == (True, 0)
        assert r["attrs"]["norm.weight"] == (False, None)  # replicated: megatron counts it once in the grad norm
    assert (r["ref_out"].abs().max() > 0.1) and r["ref_grads"][PREFIX + "hf.norm.weight"].abs().max() > 0.1
