"""Qwen3.5 text (`qwen3_5_text`) on the megatron backend, GPU: its HF gated DeltaNet (unfused in_proj_qkv / _z / _b /
_a) and gated full attention (partial, interleaved-mrope RoPE) wrapped in megatron layers (hf_wrap.py) with megatron's
dense MLP, against the FSDP backend in FP32 at TP=1 (and TP=2 with 2 GPUs) (log-probs, exact HF export round trip, grad norm; harness
`hf-wrap --family qwen3_5`), and GRPO through the CLI on both backends. One CPU test: the checkpoint's MTP tensors are
skipped by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import need_megatron_gpus
from test_megatron_gpu import _assert_ok, _gpus, _run
from tiny_models import grpo_smoke, harness


@pytest.mark.gpu
def test_hf_wrap_qwen3_5(tmp_path):
    """FP32 at TP=1 (and TP=2, the DeltaNet's unfused projections split by heads, with 2 GPUs): the packed megatron
    forward equals FSDP's padded one up to summation order (FP32_LOGP_TOL, FP32_GRAD_TOL in the harness), every
    exported tensor equals the checkpoint's bit for bit, and with 2 ranks context parallelism is refused by name."""
    need_megatron_gpus(1)
    n = 2 if _gpus() >= 2 else 1
    layouts = "tp=1;tp=2" if n == 2 else "tp=1"
    _assert_ok(_run(["hf-wrap", str(tmp_path / "m"), "--family", "qwen3_5", "--layouts", layouts, "--fp32"], nproc=n),
               3 * len(layouts.split(";")) + (n > 1))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["megatron", "fsdp"])
def test_grpo_through_the_cli(tmp_path, backend):
    """`polyrl train --train-backend {megatron,fsdp} --fp32` on the tiny Qwen3.5 (the arithmetic tokenizer), 2 GRPO
    steps with the embedded engine's transformers path: real steps (finite, non-zero grad norm), the trainer's log-probs
    of the sampled tokens equal the engine's (FP32 both, different batching and kernels: summation order only, ~1e-6;
    1e-3 as in test_gpt_oss_gpu), and --save-hf writes every tensor of the checkpoint, the DeltaNet's trained."""
    if backend == "megatron":
        need_megatron_gpus(1)
    elif not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    rows, before, after = grpo_smoke(tmp_path, "build_qwen3_5", backend)
    for name in ("model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.0.linear_attn.in_proj_b.weight",
                 "model.layers.0.linear_attn.A_log", "model.layers.1.self_attn.q_proj.weight"):
        assert not torch.equal(after[name].float(), before[name].float()), name  # trained through the backend


def test_mtp_tensors_are_skipped_with_a_warning(tmp_path, monkeypatch, caplog):
    """Released Qwen3.5 checkpoints carry multi-token-prediction tensors (`mtp.*`) that no megatron module holds: the
    bridge maps the same tensors with or without them and says by name that they are not loaded (CPU, no megatron)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from polyrl.backends.megatron import bridge
    model = harness().build_qwen3_5(str(tmp_path / "m"))
    cfg, hf = AutoConfig.from_pretrained(model), load_file(str(Path(model) / "model.safetensors"))
    plain = bridge.hf_to_mcore(hf, cfg)
    monkeypatch.setattr(bridge, "_MTP_WARNED", set())
    with caplog.at_level("WARNING", logger=bridge.__name__):
        with_mtp = bridge.hf_to_mcore({**hf, "mtp.fc.weight": torch.zeros(64, 128),
                                       "mtp.layers.0.self_attn.q_proj.weight": torch.zeros(256, 64)}, cfg)
    assert sorted(with_mtp) == sorted(plain) and all(torch.equal(with_mtp[k], plain[k]) for k in plain)
    assert "2 multi-token-prediction tensors (mtp." in caplog.text and "qwen3_5_text" in caplog.text
    assert {n for n, _ in bridge.mcore_to_hf(with_mtp.items(), cfg)} == set(hf)  # export writes the checkpoint's own
