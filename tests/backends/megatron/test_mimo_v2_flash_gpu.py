"""MiMo-V2-Flash on the megatron backend, GPU half: the HF-wrapped attention (sinks and sliding windows, q / k heads
wider than v heads) with megatron-core's dense MLP and sigmoid-routed MoELayer (correction bias fixed, groups, scaling)
against the FSDP backend in FP32 at TP=1, and TP / EP / PP 2 with 2 GPUs (log-probs, exact HF export round trip,
grad norm; harness `layouts`), and GRPO through the CLI. The CPU half (test_mimo_v2_flash_cpu.py) proves the same
arithmetic without megatron-core."""

from __future__ import annotations


import pytest
import torch
from conftest import need_megatron_gpus
from test_megatron_gpu import _assert_ok, _gpus, _run
from tiny_models import grpo_smoke


@pytest.mark.gpu
def test_fp32_parity_export_grad(tmp_path):
    """FP32 at TP=1 (with 2 GPUs also TP=2 with sequence parallelism, EP=2, TP=2 x EP=2 at expert TP 1, PP=2): log-probs
    and grad norm equal FSDP's up to summation order (FP32_LOGP_TOL, FP32_GRAD_TOL in the harness), every exported
    tensor equals the checkpoint's bit for bit."""
    need_megatron_gpus(1)
    n = 2 if _gpus() >= 2 else 1
    layouts = "tp=1;tp=2;ep=2;tp=2,ep=2,etp=1;pp=2" if n == 2 else "tp=1"
    _run(["mimo-v2-flash", str(tmp_path / "m")])
    model, ref = str(tmp_path / "m" / "mimo_v2_flash"), str(tmp_path / "ref32.pt")
    _run(["fsdp-ref", model, ref, "--fp32"])
    _assert_ok(_run(["layouts", "--models", model, "--refs", ref, "--layouts", layouts, "--fp32"], nproc=n),
               3 * len(layouts.split(";")))


@pytest.mark.gpu
def test_grpo_through_the_cli_trains_sinks_and_keeps_the_routing_bias(tmp_path):
    """`polyrl train --train-backend megatron` on the tiny MiMo-V2-Flash (the arithmetic tokenizer), FP32, 2 GRPO steps
    with the embedded engine's transformers path: real steps (finite, non-zero grad norm), the trainer's log-probs of
    the sampled tokens equal the engine's (FP32 both, different kernels and batching: summation order only, ~1e-6;
    1e-3 as on CPU in tests/test_families.py), and --save-hf exports every tensor, the sinks, router and experts
    trained, the routing correction bias unchanged (HF never moves it: bias update rate 0)."""
    need_megatron_gpus(1)
    rows, before, after = grpo_smoke(tmp_path, "build_mimo_v2_flash", "megatron")
    for name in ("model.layers.1.self_attn.attention_sink_bias", "model.layers.1.mlp.gate.weight",
                 "model.layers.0.mlp.down_proj.weight"):
        assert not torch.equal(after[name].float(), before[name].float()), name  # trained through megatron
    experts = [f"model.layers.2.mlp.experts.{e}.gate_proj.weight" for e in range(8)]  # (the routed ones move)
    assert any(not torch.equal(after[n].float(), before[n].float()) for n in experts)
    for layer in (1, 2, 3):
        name = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
        assert torch.equal(after[name].float(), before[name].float()), name
