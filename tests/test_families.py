"""GPT-OSS, MiMo (with MTP layers), MiMo-V2-Flash and Qwen3.5 (text) on CPU: the FSDP backend's log-probs equal an HF forward in FP32
(GPT-OSS and MiMo-V2-Flash on their logged eager / padded fall-back), a GRPO step through the CLI, MiMo's MTP weights kept through load
and export, the embedded engine's transformers path generating, and the GPU path's reasons (MTP training: tests/backends/test_fsdp_mtp.py)."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from polyrl import hf_families


def _family_model(family: str, tok):
    from transformers import (GptOssConfig, GptOssForCausalLM, MiMoV2FlashConfig, MiMoV2FlashForCausalLM,
                              Qwen3_5ForCausalLM, Qwen3_5TextConfig)

    common = dict(vocab_size=len(tok), hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=64, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                  bos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    if family == "gpt_oss":  # sliding window 3 < the samples' lengths, so the window changes the result
        cfg = GptOssConfig(**common, intermediate_size=32, num_hidden_layers=2, num_local_experts=4,
                           num_experts_per_tok=2, sliding_window=3, rope_parameters={
                               "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32,
                               "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "rope_theta": 10000.0})
        cls = GptOssForCausalLM
    elif family == "mimo_v2_flash":  # a dense then a sparse layer, full then sliding; v heads narrower than q/k
        cfg = MiMoV2FlashConfig(**{**common, "head_dim": 16}, v_head_dim=8, intermediate_size=96, num_hidden_layers=2,
                                layer_types=["full_attention", "sliding_attention"], mlp_layer_types=["dense", "sparse"],
                                sliding_window=3, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                                n_group=2, topk_group=1)
        cls = MiMoV2FlashForCausalLM
    elif family == "mimo":
        cfg = hf_families.MiMoConfig(**common, intermediate_size=96, num_hidden_layers=2, num_nextn_predict_layers=1)
        cls = hf_families.MiMoForCausalLM
    else:
        cfg = Qwen3_5TextConfig(**common, intermediate_size=96, num_hidden_layers=4, linear_num_key_heads=2,
                                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
        cls = Qwen3_5ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).float()
    with torch.no_grad():  # sinks and router biases are zero at init: random, so they matter
        for n, p in model.named_parameters():
            if n.endswith(("sinks", "router.bias", "_proj_bias")):
                p.normal_(std=0.5)
        for n, b in model.named_buffers():  # MiMo-V2-Flash's routing bias: zero at init, random so it picks experts
            if n.endswith("e_score_correction_bias"):
                b.normal_(std=0.5)
    return model


FAMILIES = ["gpt_oss", "mimo", "mimo_v2_flash", "qwen3_5_text"]
DENSE = ("gpt_oss", "mimo_v2_flash")  # sinks and sliding windows: HF eager attention on padded rows


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory):
    from polyrl.tasks.arithmetic import build_tokenizer

    hf_families.register()
    path = str(tmp_path_factory.mktemp(request.param))
    tok = build_tokenizer()
    tok.save_pretrained(path)
    _family_model(request.param, tok).save_pretrained(path)
    return request.param, path


def _backend(path: str):
    from polyrl.backends.fsdp.backend import FSDPBackend
    from polyrl.config import BatchConfig, ModelConfig, OptimizerConfig
    from polyrl.dist import init_distributed

    init_distributed("cpu")
    return FSDPBackend(ModelConfig(hf_checkpoint=path), OptimizerConfig(lr=1e-2), BatchConfig(), device="cpu")


def test_fsdp_logprobs_equal_hf_forward(family_dir, caplog):
    """Each sample alone through the plain HF model (eager attention where the family needs it) vs the backend's
    micro-batch of samples of different lengths. FP32; only summation order differs (padding rows change GEMM
    shapes), so 1e-5 is ~100x the observed differences."""
    from transformers import AutoModelForCausalLM

    from polyrl.types import TrainBatch

    family, path = family_dir
    with caplog.at_level(logging.INFO, logger="polyrl.backends.fsdp.backend"):
        be = _backend(path)
    dense = family in DENSE
    assert be.layout == "padded" and (be.attn_impl == "eager") == dense
    assert ("HF eager attention on padded rows" in caplog.text) == dense  # the fall-back and its reason are logged
    g = torch.Generator().manual_seed(1)
    lens, plens = [9, 6, 12], [3, 2, 5]
    ids = [torch.randint(3, be.hf_config.vocab_size, (n,), generator=g) for n in lens]
    got = be.compute_logprobs(TrainBatch(input_ids=ids, prompt_lens=plens))
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     attn_implementation="eager" if dense else "sdpa").eval()
    with torch.no_grad():
        for x, p, lp in zip(ids, plens, got):
            logits = ref_model(x[None]).logits[0].float()
            want = torch.log_softmax(logits[p - 1:-1], -1).gather(-1, x[p:, None])[:, 0]
            torch.testing.assert_close(lp, want, rtol=1e-5, atol=1e-5)


def test_fsdp_packed_layout_is_refused_for_sinks(family_dir, arith_data, capsys):
    """Sinks / sliding windows (GPT-OSS) and linear attention (Qwen3.5) cannot pack: refused at start-up from the
    checkpoint's config.json (exit 2, before any weight loads), and by the backend for direct callers."""
    family, path = family_dir
    if family == "mimo":
        pytest.skip("MiMo's Qwen2 decoder packs")
    from polyrl.backends.fsdp.backend import FSDPBackend
    from polyrl.cli import main
    from polyrl.config import BatchConfig, ModelConfig, OptimizerConfig
    from polyrl.dist import init_distributed

    assert main(["train", "--hf-checkpoint", path, "--prompt-data", arith_data["train"], "--rm-type", "arithmetic",
                 "--micro-batch-layout", "packed", "--num-rollout", "1"]) == 2
    err = capsys.readouterr().err
    assert "--micro-batch-layout packed" in err and "--train-backend fsdp" in err, err
    init_distributed("cpu")
    with pytest.raises(ValueError, match="packed"):
        FSDPBackend(ModelConfig(hf_checkpoint=path), OptimizerConfig(), BatchConfig(micro_batch_layout="packed"),
                    device="cpu")


def test_grpo_step_through_the_cli(family_dir, arith_data, tmp_path):
    """One GRPO step (embedded engine's transformers path on CPU, FSDP backend), then the exported HF directory has
    every tensor of the checkpoint, MiMo's MTP layers included and, untrained, unchanged."""
    from safetensors.torch import load_file

    from polyrl.cli import main

    family, path = family_dir
    run = tmp_path / "run"
    rm = tmp_path / "rm.py"  # random weights answer nothing right: a reward that differs within a group instead
    rm.write_text("def r(sample):\n    return float(sum(sample.rollout_logprobs))\n")
    assert main(["train", "--hf-checkpoint", path, "--prompt-data", arith_data["train"], "--custom-rm-path", f"{rm}:r",
                 "--quiet", "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                 "--rollout-max-response-len", "4", "--run-dir", str(run), "--save-hf", str(tmp_path / "hf")]) == 0
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert len(rows) == 1 and rows[0]["grad_norm"] > 0 and not rows[0]["skipped_step"], rows  # a real step
    # the engine's sampled log-probs and the trainer's agree (FP32 both, different batching: summation order only)
    assert rows[0]["train_rollout_logprob_abs_diff_max"] < 1e-3, rows
    before, after = load_file(os.path.join(path, "model.safetensors")), load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(after) == set(before)
    mtp = [n for n in before if ".mtp_layers." in n]
    assert bool(mtp) == (family == "mimo")
    assert all(torch.equal(before[n], after[n]) for n in mtp)


def test_gpt_oss_mxfp4_checkpoint_trains_and_exports_unquantized(arith_data, tmp_path):
    """An MXFP4 checkpoint (experts as E2M1 blocks + power-of-two scales, `quantization_config` mxfp4): the FSDP backend
    and the engine both read the experts dequantized (bit-equal to polyrl.backends.mxfp4, itself equal to transformers'
    dequantizer), a GRPO step runs, and --save-hf writes a plain checkpoint (no quantization_config) that loads back
    with its trained experts."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from polyrl.backends.mxfp4 import dequantize_mxfp4
    from polyrl.cli import main
    from polyrl.tasks.arithmetic import build_tokenizer

    src = tmp_path / "mxfp4"
    tok = build_tokenizer()
    tok.save_pretrained(src)
    _family_model("gpt_oss", tok).save_pretrained(src)
    sd, g, quant = load_file(str(src / "model.safetensors")), torch.Generator().manual_seed(0), {}
    for layer in range(2):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            E, cols, rows = sd.pop(name).shape  # HF [E, in, out]; MXFP4 stores [E, out, in / 32, 16]
            quant[name] = (torch.randint(0, 256, (E, rows, cols // 32, 16), dtype=torch.uint8, generator=g),
                           torch.randint(124, 130, (E, rows, cols // 32), dtype=torch.uint8, generator=g))
            sd[name + "_blocks"], sd[name + "_scales"] = quant[name]
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    conf = json.loads((src / "config.json").read_text())
    conf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (src / "config.json").write_text(json.dumps(conf))

    got = dict(_backend(str(src)).export_weights())
    for name, (blocks, scales) in quant.items():  # E2M1 x 2^k is exact in BF16 and FP32
        assert torch.equal(got[name].float(), dequantize_mxfp4(blocks, scales).float()), name

    rm = tmp_path / "rm.py"
    rm.write_text("def r(sample):\n    return float(sum(sample.rollout_logprobs))\n")
    out = tmp_path / "hf"
    assert main(["train", "--hf-checkpoint", str(src), "--prompt-data", arith_data["train"], "--custom-rm-path",
                 f"{rm}:r", "--quiet", "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                 "--rollout-max-response-len", "4", "--lr", "1e-2", "--run-dir", str(tmp_path / "run"),
                 "--save-hf", str(out)]) == 0
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    # the engine read the same dequantized experts: its log-probs and the trainer's differ by summation order only
    assert row["grad_norm"] > 0 and row["train_rollout_logprob_abs_diff_max"] < 1e-3, row
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    saved = load_file(str(out / "model.safetensors"))
    assert not any(n.endswith(("_blocks", "_scales")) for n in saved)
    back = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).state_dict()
    for name in quant:
        assert torch.equal(back[name], saved[name].float())
        assert not torch.equal(saved[name].float(), got[name].float())  # trained (lr 1e-2), not the read weights


def test_fsdp_export_keeps_mimo_mtp_weights(tmp_path):
    from polyrl.tasks.arithmetic import build_tokenizer

    hf_families.register()
    tok = build_tokenizer()
    tok.save_pretrained(tmp_path)
    model = _family_model("mimo", tok)
    model.save_pretrained(tmp_path)
    be = _backend(str(tmp_path))
    got = dict(be.export_weights())
    want = model.state_dict()
    assert set(got) == set(want) and any(".mtp_layers.0.input_proj" in n for n in got)
    assert all(torch.equal(got[n].float(), want[n]) for n in want)


def test_embedded_engine_generates_on_cpu(family_dir):
    """The transformers path (every CPU run) samples from each family; greedy equals HF's own generate."""
    from transformers import AutoModelForCausalLM

    from polyrl.rollout.embedded import make_embedded_engine
    from polyrl.types import SamplingParams
    from tests.conftest import hf_greedy

    family, path = family_dir
    eng = make_embedded_engine(path, device="cpu")
    prompt = [5, 9, 12, 7]  # arithmetic tokens of the tiny tokenizer
    out = eng.generate([prompt], SamplingParams(max_new_tokens=5, temperature=0.0))[0]
    assert 1 <= len(out.response_ids) <= 5 and len(out.rollout_logprobs) == len(out.response_ids)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                               attn_implementation="eager" if family in DENSE else "sdpa").eval()
    assert out.response_ids == hf_greedy(ref, prompt, 5, eng.tokenizer.eos_token_id, eng.tokenizer.pad_token_id)


def test_embedded_engine_drops_finished_rows(family_dir):
    """A batch whose first row leaves after one token (aborted) goes on decoding the others from the cache's remaining
    rows: each equals the same prompt generated alone (for Qwen3.5, the linear-attention states are selected too)."""
    from polyrl.rollout.embedded import make_embedded_engine
    from polyrl.types import SamplingParams

    family, path = family_dir
    eng = make_embedded_engine(path, device="cpu")
    prompts = [[5, 9, 12, 7], [6, 8], [7, 7, 11]]  # different lengths: left padding differs per row
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=[])
    batched = eng.generate(prompts, sp, should_stop=lambda i: i == 0)
    assert batched[0].finish_reason == "abort" and len(batched[0].response_ids) == 1
    for p, got in zip(prompts[1:], batched[1:]):
        alone = eng.generate([p], sp)[0]
        assert got.response_ids == alone.response_ids and got.finish_reason == alone.finish_reason
        # FP32, the same tokens, a different batch (padding): the log-probs differ by summation order only
        assert max(abs(a - b) for a, b in zip(got.rollout_logprobs, alone.rollout_logprobs)) < 1e-4
    assert any(len(s.response_ids) > 1 for s in batched[1:])  # some row did decode after the first one left


def test_gpu_path_names_why_not(family_dir):
    """The GPU engine path runs MiMo-7B (its Qwen2 decoder; tests/rollout/test_paged_engine_cpu.py) and names what
    it lacks for the others."""
    from polyrl.rollout.gpu import unsupported_reason

    family, path = family_dir
    why = unsupported_reason(path)
    if family == "mimo":
        assert why is None
        return
    assert why and {"gpt_oss": "attention sinks", "mimo_v2_flash": "attention sinks", "qwen3_5_text": "DeltaNet"}[family] in why


def test_embedded_engine_samples_of_a_prompt_share_its_prefill(family_dir):
    """n samples of one prompt are prefilled once and the cache rows copied (for Qwen3.5, the linear-attention states
    too): each greedy sample equals the prompt's single greedy sample."""
    from polyrl.rollout.embedded import make_embedded_engine
    from polyrl.types import SamplingParams

    family, path = family_dir
    eng = make_embedded_engine(path, device="cpu")
    prompts = [[5, 9, 12, 7], [6, 8], [7, 7, 11]]
    sp = dict(max_new_tokens=6, temperature=0.0, stop_token_ids=[])
    one = eng.generate(prompts, SamplingParams(n=1, **sp))
    two = eng.generate(prompts, SamplingParams(n=2, **sp))
    for i, s in enumerate(one):
        assert two[2 * i].response_ids == two[2 * i + 1].response_ids == s.response_ids
        assert max(abs(a - b) for a, b in zip(two[2 * i + 1].rollout_logprobs, s.rollout_logprobs)) < 1e-4
