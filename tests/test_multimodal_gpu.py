"""Image prompts on CUDA: a tiny Qwen2.5-VL (polyrl.tasks.counting, built from a config) through the FSDP backend in
BF16 with packed varlen micro-batches, and GRPO steps through the CLI with the embedded engine. The non-causal branch
of the varlen attention (the vision tower's) is checked on CPU too.

GPU parts: `make test-gpu`, or `PYTHONPATH=. python3 -m pytest tests/test_multimodal_gpu.py -m gpu -rs`.
"""

from __future__ import annotations

import json

import pytest
import torch

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with make test-gpu on a GPU machine)")


def test_varlen_attention_is_bidirectional_sdpa_for_the_vision_tower():
    """Qwen-VL's vision attention calls the registered attention once per image (is_causal=False) with the text's
    cu_seqlens in its kwargs: the varlen function must attend over the whole chunk, not causally by those offsets.
    Exact: the same SDPA call."""
    from polyrl.backends.fsdp.attention import _varlen_forward
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(3))
    out, _ = _varlen_forward(None, q, k, v, None, scaling=0.3, is_causal=False,
                             cu_seq_lens_q=torch.tensor([0, 2, 9]), max_length_q=7)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.3).transpose(1, 2)
    torch.testing.assert_close(out, want, atol=0, rtol=0)


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory) -> str:
    from polyrl.tasks import counting
    path = tmp_path_factory.mktemp("qwen2_5_vl_gpu")
    counting.build_model(str(path), arch="qwen2_5_vl", hidden=128)
    return str(path)


@gpu
@pytest.mark.gpu
def test_packed_bf16_logprobs_equal_unpacked_hf_forward(vl_model):
    """6 samples (1 or 2 images each, one text-only) packed into one varlen row give the log-probs of each sample
    alone through the HF model (sdpa), both in BF16. Bound: BF16 keeps 8 mantissa bits, so each matmul output and
    each activation is rounded to a relative 2^-9 (~0.002); the two runs round at different places (flash varlen vs
    sdpa kernels, one row vs six), and a log-prob sums the rounding of a few hundred logits through 2 text layers and
    2 vision blocks: mean |diff| < 0.02 and max < 0.1, the bounds tests/backends/test_fsdp_gpu.py holds for text (a
    wrong position, image feature or sequence boundary moves log-probs by O(1))."""
    from transformers import AutoModelForImageTextToText

    from polyrl.backends.fsdp.backend import FSDPBackend
    from polyrl.config import BatchConfig, ModelConfig, OptimizerConfig
    from polyrl.dist import init_distributed
    from polyrl.multimodal import VisionProcessor
    from test_multimodal import image_batch

    init_distributed("cuda")
    be = FSDPBackend(ModelConfig(hf_checkpoint=vl_model), OptimizerConfig(lr=1e-3), BatchConfig(micro_batch_size=8),
                     device="cuda")
    assert be.attn_impl == "varlen" and be.layout == "packed"
    proc = VisionProcessor.from_pretrained(vl_model)
    batch = image_batch(proc)
    got = be.compute_logprobs(batch)
    ref = AutoModelForImageTextToText.from_pretrained(vl_model, dtype=torch.bfloat16, attn_implementation="sdpa")
    ref = ref.cuda().eval()
    diffs = []
    with torch.no_grad():
        for ids, p, mm, lp in zip(batch.input_ids, batch.prompt_lens, batch.multimodal, got):
            kw = {} if mm is None else {k: v.cuda() for k, v in mm.items()}
            if mm is not None:
                kw["mm_token_type_ids"] = (ids == proc.image_token_id).int()[None].cuda()
            logits = ref(input_ids=ids[None].cuda(), **kw).logits[0].float()
            want = torch.log_softmax(logits[p - 1:-1], -1).gather(-1, ids[p:, None].cuda())[:, 0].cpu()
            diffs.append((lp - want).abs())
    d = torch.cat(diffs)
    assert d.mean() < 0.02 and d.max() < 0.1, (float(d.mean()), float(d.max()))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_grpo_steps_with_images_through_the_cli_on_cuda(vl_model, tmp_path, backend):
    """2 GRPO steps on CUDA: the embedded engine generates from the images (its transformers path: the GPU fast path
    does not run VL models), the backend trains in BF16 (FSDP: packed varlen micro-batches; Megatron: the HF vision
    tower on the first stage, its features in the decoder input), the weights reach the engine. Each step trains (finite loss, a gradient). The engine's rollout log-probs and the trainer's agree within
    0.1 on average: the engine samples with the image / video pads excluded, which for random weights over a
    45-token vocabulary shifts every log-prob by log(1 - 2/45) ~ 0.046, plus the BF16 rounding bounded above (0.02)."""
    from polyrl.cli import main
    from polyrl.tasks import counting

    if backend == "megatron":
        pytest.importorskip("megatron.core", reason="the Megatron backend needs megatron-core (docs/megatron.md)")
    data = counting.write_datasets(str(tmp_path / "data"), n_train=32, n_eval=8, seed=0)
    rm = tmp_path / "rm.py"  # random weights answer nothing right: a reward that differs within a group instead
    rm.write_text("def r(sample):\n    return float(sum(sample.response_ids) % 5 + len(sample.response_ids))\n")
    run = tmp_path / "run"
    assert main(["train", "--hf-checkpoint", vl_model, "--prompt-data", data["train"], "--multimodal-keys",
                 '{"image": "images"}', "--apply-chat-template", "--custom-rm-path", f"{rm}:r", "--device", "cuda",
                 "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "3",
                 "--num-rollout", "2", "--run-dir", str(run), "--quiet", "--train-backend", backend]) == 0
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["skipped_step"] == 0.0 and r["grad_norm"] > 0 and r["reward/samples"] == 16, \
            {k: v for k, v in r.items() if k.startswith(("reward", "response", "grad", "loss", "train_rollout"))}
        assert r["train_rollout_logprob_abs_diff"] < 0.1, r
