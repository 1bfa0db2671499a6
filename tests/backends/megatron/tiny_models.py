"""The CPU tests' tiny HF models of the Megatron families, built by harness.py's builders (the GPU harness's own
models), loaded once per module in FP32."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch


def harness():
    """harness.py as a module (it is a script the GPU tests launch under torchrun, not a package member)."""
    spec = importlib.util.spec_from_file_location("megatron_harness", Path(__file__).with_name("harness.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny_hf(tmp_path_factory, builder: str, attn: str, **kw):
    """(model dir, its config, the HF model in FP32 eval mode) of harness.<builder>."""
    from transformers import AutoConfig, AutoModelForCausalLM
    d = getattr(harness(), builder)(str(tmp_path_factory.mktemp(builder)), **kw)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation=attn).eval()
    return d, AutoConfig.from_pretrained(d), model


def grpo_smoke(tmp_path, builder: str, backend: str = "megatron") -> tuple[list[dict], dict, dict]:
    """`polyrl train --train-backend BACKEND --fp32` on harness.<builder>'s tiny model (the arithmetic tokenizer), 2
    GRPO steps with the embedded engine's transformers path and --save-hf. Checks what every family must show: real
    steps (finite loss, non-zero grad norm, none skipped), the trainer's log-probs of the sampled tokens equal to the
    engine's (FP32 both, different batching and kernels: summation order only, ~1e-6; bound 1e-3), and an export with
    every tensor of the checkpoint. Returns (metrics rows, checkpoint tensors, exported tensors) for the caller's
    family-specific checks (which tensors trained)."""
    import math

    from safetensors.torch import load_file

    from polyrl.tasks.arithmetic import build_tokenizer, write_datasets
    from test_megatron_gpu import _polyrl_train
    model = getattr(harness(), builder)(str(tmp_path / "m"), tokenizer=build_tokenizer())
    write_datasets(str(tmp_path / "d"), digits=2, n_train=64, n_eval=16)
    rm = tmp_path / "rm.py"  # random weights answer nothing right: a reward that differs within a group instead
    rm.write_text("def r(sample):\n    return float(sum(sample.rollout_logprobs))\n")
    rows = _polyrl_train(["--train-backend", backend, "--hf-checkpoint", model, "--prompt-data",
                          str(tmp_path / "d" / "train.jsonl"), "--custom-rm-path", f"{rm}:r",
                          "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6",
                          "--lr", "1e-3", "--fp32", "--num-rollout", "2", "--quiet", "--save-hf", str(tmp_path / "hf")],
                         1, tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2], rows
    for r in rows:
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0 and not r["skipped_step"], r
        assert r["train_rollout_logprob_abs_diff_max"] < 1e-3, r
    before = load_file(str(Path(model) / "model.safetensors"))
    after = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(after) == set(before)
    return rows, before, after
