"""GPT-OSS on the megatron backend, GPU half: megatron-core's MoELayer (biased router, biased experts with the clamped
SwiGLU from its config fields) under the HF-wrapped sink / sliding attention against the FSDP backend in FP32 at TP=1
(log-probs, exact HF export round trip, grad norm; harness `layouts`), and GRPO through the CLI. The CPU half
(test_gpt_oss_cpu.py) proves the same arithmetic without megatron-core."""

from __future__ import annotations


import pytest
import torch
from conftest import need_megatron_gpus
from test_megatron_gpu import _assert_ok, _run
from tiny_models import grpo_smoke


@pytest.mark.gpu
def test_fp32_tp1_parity_export_grad(tmp_path):
    need_megatron_gpus(1)
    _run(["gpt-oss", str(tmp_path / "m")])
    model, ref = str(tmp_path / "m" / "gpt_oss"), str(tmp_path / "ref32.pt")
    _run(["fsdp-ref", model, ref, "--fp32"])
    _assert_ok(_run(["layouts", "--models", model, "--refs", ref, "--layouts", "tp=1", "--fp32"], nproc=1), 3)


@pytest.mark.gpu
def test_grpo_through_the_cli_trains_router_and_expert_biases(tmp_path):
    """`polyrl train --train-backend megatron` on the tiny GPT-OSS (the arithmetic tokenizer), FP32, 2 GRPO steps with
    the embedded engine's transformers path: real steps (finite, non-zero grad norm), the trainer's log-probs of the
    sampled tokens equal the engine's (FP32 both, different kernels and batching: summation order only, ~1e-6; 1e-3
    as on CPU in tests/test_families.py), and --save-hf exports every tensor with the biases trained."""
    need_megatron_gpus(1)
    rows, before, after = grpo_smoke(tmp_path, "build_gpt_oss", "megatron")
    for name in ("model.layers.0.mlp.router.bias", "model.layers.1.mlp.experts.gate_up_proj_bias",
                 "model.layers.1.mlp.experts.down_proj_bias", "model.layers.0.self_attn.sinks"):
        assert not torch.equal(after[name].float(), before[name].float()), name  # trained through megatron
