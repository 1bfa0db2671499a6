"""--true-on-policy on CUDA in BF16: the GPU engine (paged KV cache, CUDA graphs) samples with its own kernels and
reports each sample's log-probs from the trainer's scoring function over its own weights; the FSDP trainer scores the
same sequences alone. Every loss-masked token of 3 GRPO steps must agree bit for bit (read from the loss's raw
per-token values, tests/test_true_on_policy.py's spy), at two batch sizes, on the Qwen2.5-0.5B shape (random weights)
and on tiny Qwen3 and Llama shapes. Run with `make test-gpu`.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from conftest import make_model_dir
from test_true_on_policy import assert_every_token_exact, install_spy, rows

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with make test-gpu on a GPU machine)")

# partial credit from the token ids: random weights rarely write digits, and the steps must change the weights
REWARD = '''
def ids(sample):
    return (sum(sample.response_ids) % 10) / 10.0
'''


@pytest.fixture(scope="module")
def half_b(tmp_path_factory):
    """The Qwen2.5-0.5B shape with random BF16 weights (bench/common.py's builder)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    from common import build_model_dir
    out = str(tmp_path_factory.mktemp("qwen05b"))
    build_model_dir(out, "qwen2.5-0.5b")
    return out


def run_exact(model: str, data: str, tmp_path, monkeypatch, *extra: str) -> tuple[list[dict], list[dict], list[tuple]]:
    from polyrl.cli import main
    from polyrl.rollout.gpu.engine import GPUEngine
    records = install_spy(monkeypatch.setattr)
    engines: list[tuple] = []
    generate = GPUEngine.generate

    def seen(self, prompts, params):
        out = generate(self, prompts, params)
        engines.append((self.cuda_graph, len(self.graphs), self.rescore is not None))
        return out
    monkeypatch.setattr(GPUEngine, "generate", seen)
    rm = tmp_path / "rm.py"
    rm.write_text(REWARD)
    run = tmp_path / "run"
    argv = ["train", "--hf-checkpoint", model, "--prompt-data", data, "--custom-rm-path", f"{rm}:ids",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "16",
            "--lr", "1e-3", "--num-rollout", "3", "--quiet", "--seed", "3", "--device", "cuda", "--true-on-policy",
            "--ci-train-rollout-logprob-abs-diff-threshold", "0", "--run-dir", str(run),
            # several runs share this process: what an earlier one's caching allocator keeps is not free for the next
            "--rollout-mem-fraction", "0.1", *extra]
    import gc
    gc.collect()
    torch.cuda.empty_cache()
    assert main(argv) == 0
    return rows(run), records, engines


def assert_exact(rs: list[dict], records: list[dict], engines: list[tuple]) -> None:
    assert [r["step"] for r in rs] == [1, 2, 3]
    for r in rs:
        assert r["train_rollout_logprob_abs_diff_max"] == 0.0 and r["train_rollout_logprob_abs_diff"] == 0.0, r
        assert r["grad_norm"] > 0
        # the control: the CUDA-graph decode's own log-probs differ from the reported ones (BF16 kernels of another
        # shape), so an exact zero above is the scoring function's doing
        assert r["rollout/sampler_logprob_abs_diff_max"] > 0
    # every call went through the GPU engine with captured CUDA graphs and the scorer
    assert engines and all(g and n > 0 and scored for g, n, scored in engines), engines
    assert 3 * 16 <= assert_every_token_exact(records) <= 3 * 16 * 16
    assert {r["call"] for r in records} == {1, 2, 3}


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("extra", [["--micro-batch-size", "1"], ["--micro-batch-size", "8", "--rollout-batch-generate", "3"]],
                         ids=["mbs1", "mbs8_gen3"])
def test_half_b_shape_bf16_exact_over_three_steps(half_b, arith_data, tmp_path, monkeypatch, extra):
    assert_exact(*run_exact(half_b, arith_data["train"], tmp_path, monkeypatch, *extra))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_tiny_qwen3_and_llama_bf16_exact(arch, arith_data, tmp_path, monkeypatch):
    model = make_model_dir(tmp_path / arch, arch=arch, hidden=128, layers=2, tied=arch == "qwen3")
    assert_exact(*run_exact(model, arith_data["train"], tmp_path, monkeypatch, "--micro-batch-size", "3"))
