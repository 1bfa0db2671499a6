"""--true-on-policy with --train-backend megatron (TP1) on CUDA in BF16: the GPU engine samples with its own kernels and
reports each sample's log-probs from the scoring function over its weights; megatron's trainer scores the same
sequences with the same function over tensors derived from its own parameters (polyrl/backends/megatron/exact.py).
Every loss-masked token of 3 GRPO steps must agree bit for bit (the loss's raw per-token values), on the Qwen2.5-0.5B
shape (random weights, tied embeddings, QKV biases) with and without --gradient-checkpointing, and on tiny Qwen3 and
Llama (untied) shapes. Each run is a process of its own (megatron's parallel state is global).

Skipped with a reason on CPU or without megatron-core (Python 3.12, GPU machines: make test-gpu-exact).
"""

from __future__ import annotations

import os
import sys

import pytest
from conftest import make_model_dir, need_megatron_gpus

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/backends: the FSDP exact tests' helpers


@pytest.fixture
def one_gpu():
    """Skip (before own_process starts a process for the test) unless megatron-core and a GPU are here."""
    need_megatron_gpus(1)


@pytest.fixture(scope="module")
def half_b(tmp_path_factory):
    need_megatron_gpus(1)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "bench"))
    from common import build_model_dir
    out = str(tmp_path_factory.mktemp("qwen05b"))
    build_model_dir(out, "qwen2.5-0.5b")
    return out


def _exact(model: str, data: str, tmp_path, monkeypatch, *extra: str) -> None:
    from polyrl.backends.megatron.backend import MegatronBackend
    from test_true_on_policy_gpu import assert_exact, run_exact
    rs, records, engines = run_exact(model, data, tmp_path, monkeypatch, "--train-backend", "megatron", *extra,
                                     backend=MegatronBackend)
    assert_exact(rs, records, engines)


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [["--micro-batch-size", "3"], ["--micro-batch-size", "8", "--gradient-checkpointing"]],
                         ids=["mbs3", "mbs8_checkpointing"])
def test_half_b_shape_megatron_tp1_exact_over_three_steps(one_gpu, half_b, arith_data, tmp_path, monkeypatch, own_process,
                                                          extra):
    if own_process:
        return
    _exact(half_b, arith_data["train"], tmp_path, monkeypatch, *extra)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_tiny_qwen3_and_llama_megatron_tp1_exact(one_gpu, arch, arith_data, tmp_path, monkeypatch, own_process):
    if own_process:
        return
    model = make_model_dir(tmp_path / arch, arch=arch, hidden=128, layers=2, tied=arch == "qwen3")
    _exact(model, arith_data["train"], tmp_path, monkeypatch, "--micro-batch-size", "1")
