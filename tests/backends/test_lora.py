"""LoRA on the FSDP backend (peft): what trains, the reference model, the merged export, checkpoints, 2 ranks.

Tolerances (fp32 on CPU):
- The reference (adapters off) runs the same Linear layers on the same inputs as the plain model: bitwise equal.
- A merged layer computes x @ (W + s * B @ A)^T where the adapted one computes x @ W^T + s * (x @ A^T) @ B^T: the same
  sums grouped differently, a few fp32 ulps per layer; through two layers and a log-softmax of 14 entries that stays
  far below 1e-5 on log-probs of size ~3 (the packed-vs-unpacked tests use the same bound).
- A resume does the same arithmetic in the same order as the uninterrupted run: ~1 ulp (atol 1e-6).
"""

from __future__ import annotations

import functools
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from fsdp_worker import fixed_batch  # noqa: E402
from test_fsdp_equivalence import assert_equivalent, run_worker  # noqa: E402

from polyrl.algorithms.losses import LossSettings, rl_loss  # noqa: E402
from polyrl.config import BatchConfig, ConfigError, ModelConfig, OptimizerConfig  # noqa: E402

pytest.importorskip("peft")  # `make install` installs it (the test extra); LoRA itself raises an install hint

LOSS = functools.partial(rl_loss, s=LossSettings())


def backend(model_dir: str, **model):
    from polyrl.backends.fsdp.backend import FSDPBackend
    from polyrl.dist import init_distributed
    init_distributed("cpu")
    return FSDPBackend(ModelConfig(hf_checkpoint=model_dir, **model), OptimizerConfig(lr=1e-2), BatchConfig(micro_batch_size=8),
                       device="cpu", total_steps=8, need_ref=True)


def hf_logprobs(model, batch) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for ids, p in zip(batch.input_ids, batch.prompt_lens):
            logits = model(ids[None]).logits[0, p - 1:-1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[p:, None]).squeeze(-1))
    return out


def test_only_adapters_train_the_base_stays_and_the_export_has_the_base_names(tiny_model):
    plain = backend(tiny_model)
    be = backend(tiny_model, lora_rank=4, lora_alpha=8, lora_dropout=0.1)
    trainable = {n for n, p in be.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {id(p) for g in be.optimizer.param_groups for p in g["params"]} == \
        {id(p) for p in be.model.parameters() if p.requires_grad}
    # all-linear: the 7 projections of each of the 2 layers, an A and a B each; not the (tied) output layer
    assert len(trainable) == 2 * 7 * 2 and not any("lm_head" in n or "embed" in n for n in trainable)
    assert be.ref_model is None  # the reference is the actor with its adapters off
    base_names = [n for n, _ in plain.export_weights()]
    assert [n for n, _ in be.export_weights()] == base_names  # no lora tensors, no peft prefixes
    before = {n: p.detach().clone() for n, p in be.model.named_parameters()}
    merged0 = dict(be.export_weights())
    for n, t in plain.export_weights():
        assert torch.equal(merged0[n], t), n  # B starts at 0: the merged model is the base model
    batch = fixed_batch()
    for _ in range(2):
        m = be.train_step(batch, LOSS)
        assert m["grad_norm"] > 0 and m["skipped_step"] == 0
    for n, p in be.model.named_parameters():
        changed = not torch.equal(p.detach(), before[n])
        assert changed == (n in trainable), n  # A moves from the 2nd step on (its gradient is 0 while B is 0)
    assert any(not torch.equal(t, merged0[n]) for n, t in be.export_weights())
    # scoring runs without dropout: twice the same
    a, b = be.compute_logprobs(batch), be.compute_logprobs(batch)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_ref_logprobs_are_the_base_models_and_adapters_come_back_on(tiny_model):
    plain = backend(tiny_model)
    be = backend(tiny_model, lora_rank=4)
    batch = fixed_batch()
    for _ in range(3):
        be.train_step(batch, LOSS)
    ref, actor = be.compute_logprobs(batch, model="ref"), be.compute_logprobs(batch)
    base = plain.compute_logprobs(batch)
    for r, b, a in zip(ref, base, actor):
        assert torch.equal(r, b)  # bitwise: the same layers on the same inputs (module docstring)
        assert not torch.equal(a, b)
    assert all(p.requires_grad for n, p in be.model.named_parameters() if ".lora_" in n)  # still trainable after
    assert all(torch.equal(x, y) for x, y in zip(actor, be.compute_logprobs(batch)))  # adapters are back on


def test_merged_and_adapter_exports_reload_and_match_the_trained_model(tiny_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    be = backend(tiny_model, lora_rank=4, lora_alpha=16)
    batch = fixed_batch()
    for _ in range(3):
        be.train_step(batch, LOSS)
    trained = be.compute_logprobs(batch)
    be.save_hf(str(tmp_path / "merged"), AutoTokenizer.from_pretrained(tiny_model))
    be.save_hf(str(tmp_path / "adapter"), adapter=True)
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    exported = dict(be.export_weights())
    assert set(dict(merged.named_parameters())) <= set(exported)
    for n, p in merged.named_parameters():
        assert torch.equal(p, exported[n]), n  # the file holds exactly what the engines are sent
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(tmp_path / "adapter"))
    conf = json.load(open(tmp_path / "adapter" / "adapter_config.json"))
    assert (conf["r"], conf["lora_alpha"], conf["peft_type"]) == (4, 16, "LORA")
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(tmp_path / "adapter")).eval()
    for model in (merged, adapted):
        for got, want in zip(hf_logprobs(model, batch), trained):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)  # fp32 regrouping (module docstring)
    assert max(float((a - b).abs().max()) for a, b in zip(trained, be.compute_logprobs(batch, model="ref"))) > 1e-2


def test_resume_is_exact_and_checkpoints_hold_only_adapters(tiny_model, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from polyrl.checkpoint import load_checkpoint, save_checkpoint
    batch, kw = fixed_batch(), dict(lora_rank=4, lora_dropout=0.1)  # dropout: the RNG state must resume too
    straight = backend(tiny_model, **kw)
    norms = [straight.train_step(batch, LOSS)["grad_norm"] for _ in range(3)]
    first = backend(tiny_model, **kw)
    for _ in range(2):
        first.train_step(batch, LOSS)
    save_checkpoint(str(tmp_path / "ck"), 2, first, {"step": 2})
    keys = FileSystemReader(str(tmp_path / "ck" / "step_000002" / "dcp")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)  # no base weights
    assert any(k.startswith("optim.") for k in keys)
    resumed = backend(tiny_model, **kw)
    assert load_checkpoint(str(tmp_path / "ck"), resumed)["step"] == 2
    assert resumed.train_step(batch, LOSS)["grad_norm"] == pytest.approx(norms[2], rel=1e-6)
    want = dict(straight.model.named_parameters())
    for n, p in resumed.model.named_parameters():
        torch.testing.assert_close(p.detach(), want[n].detach(), atol=1e-6, rtol=0, msg=lambda m: f"{n}: {m}")


@pytest.mark.slow
def test_two_ranks_match_one_rank_and_merge_sharded_adapters(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM
    one = run_worker(tiny_model, str(tmp_path / "one.pt"), 1, "--lora-rank", "4")
    two = run_worker(tiny_model, str(tmp_path / "two.pt"), 2, "--lora-rank", "4")
    assert one["losses"][0][1] > 0 and all(".lora_" in k for k in one["weights"])
    assert_equivalent(one, two)
    # the 2-rank export gathers the shards and merges: W + (alpha / r) * B @ A from the saved base and adapters
    base = dict(AutoModelForCausalLM.from_pretrained(tiny_model).named_parameters())
    ad, merged = two["weights"], two["merged"]
    assert merged.keys() == {n for n in base if n != "lm_head.weight"}
    for n, w in base.items():
        if n == "lm_head.weight":
            continue
        owner, leaf = n.rsplit(".", 1)
        a = ad.get(f"{owner}.lora_A.default.weight")  # None: not an adapted layer (embedding, norms)
        want = w.detach() + (16 / 4) * ad[f"{owner}.lora_B.default.weight"] @ a if a is not None and leaf == "weight" else w.detach()
        torch.testing.assert_close(merged[n], want, atol=1e-6, rtol=0, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("argv, needle", [
    (["--lora-rank", "4", "--train-backend", "megatron", "--use-megatron-fsdp"], "--lora-rank with --use-megatron-fsdp"),
    (["--lora-alpha", "32"], "--lora-alpha configure LoRA: add --lora-rank"),
    (["--lora-rank", "4", "--save-hf-adapter"], "--save-hf-adapter chooses what --save-hf writes"),
    (["--lora-rank", "4", "--lora-target-modules", "q_proj,,v_proj"], "--lora-target-modules"),
    (["--lora-rank", "4", "--lora-dropout", "1.0"], "--lora-dropout must be in [0, 1)"),
    (["--lora-rank", "4", "--use-kl-loss", "--kl-loss-coef", "0.1", "--ref-update-interval", "2"], "--ref-update-interval"),
])
def test_bad_lora_flags_name_the_flag(argv, needle, tiny_model, arith_data, capsys):
    from polyrl.cli import main
    base = ["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--rm-type", "arithmetic"]
    assert main(base + argv) == 2
    assert needle in capsys.readouterr().err


def test_target_modules_the_model_lacks_name_the_flag(tiny_model):
    with pytest.raises(ConfigError, match="--lora-target-modules 'nope_proj'"):
        backend(tiny_model, lora_rank=4, lora_target_modules="nope_proj")


@pytest.mark.parametrize("device", ["cpu", "cpu-bf16", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu)")])])
def test_lora_grpo_learns_and_the_engine_samples_the_merged_policy(tiny_model, arith_data, tmp_path, device):
    """`polyrl train --lora-rank` end to end on the arithmetic prompts, with a target a random model can find by sampling:
    the answer 7 to every prompt (1 token; a random policy hits it ~1/14 of the time, so GRPO has signal from step 1).
    Greedy held-out accuracy goes from 0 to > 0.8 within 5 steps only if the adapters train AND the engine samples
    the merged weights (the greedy eval runs on the engine). The demo task itself needs an SFT warm start first:
    examples/lora/README.md has that run. cpu-bf16: BF16 on CPU takes the sharded FSDP2 path of a GPU (mixed precision,
    parameters kept unsharded after the forward), where peft's own adapter switch once left the adapters frozen."""
    from polyrl.cli import main
    extra = ["--bf16"] if device == "cpu-bf16" else []
    device = device.split("-")[0]
    data = {}
    for split in ("train", "eval"):
        rows = [json.loads(line) for line in open(arith_data[split])]
        data[split] = tmp_path / f"{split}.jsonl"
        data[split].write_text("".join(json.dumps({"prompt": r["prompt"], "label": "7"}) + "\n" for r in rows))
    run = tmp_path / "run"
    assert main(["train", "--device", device, "--hf-checkpoint", tiny_model, "--prompt-data", str(data["train"]), "--rm-type", "arithmetic",
                 "--eval-prompt-data", str(data["eval"]), "--eval-interval", "5", "--num-rollout", "5",
                 "--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--rollout-max-response-len", "1",
                 "--micro-batch-size", "128", "--lr", "1e-2", "--lora-rank", "8", "--use-kl-loss", "--kl-loss-coef", "0.001",
                 "--rollout-shuffle", "--seed", "1", "--quiet", "--run-dir", str(run), "--save-hf", str(tmp_path / "hf"),
                 "--save-hf-adapter", *extra]) == 0
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    acc = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    assert acc[0] < 0.2 and acc[5] > 0.8, acc
    # the engine samples what the trainer scores: FP32 on CPU (~1e-6), BF16 rounding on GPU (~1e-2)
    assert rows[-1]["train_rollout_logprob_abs_diff"] < (1e-4 if device == "cpu" and not extra else 5e-2)
    # the reference is the base: KL starts at 0 and grows. Exactly 0 in FP32 on CPU; in BF16 the reference pass (adapters
    # off) and the actor's (adapters on, B = 0) may run differently fused kernels (compiled layers on CUDA), so their
    # log-probs differ by BF16 rounding, |d| <~ 1e-2, and the k3 KL estimate ~ d^2 / 2 stays under 1e-4 (3.5e-7 seen on
    # an H100)
    assert rows[1]["kl"] <= (0.0 if device == "cpu" and not extra else 1e-4) and rows[-1]["kl"] > 0
    assert os.path.isfile(tmp_path / "hf" / "adapter_config.json")
