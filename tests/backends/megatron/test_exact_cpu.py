"""--true-on-policy on the Megatron backend, its pure part (polyrl/backends/megatron/exact.py) on the CPU: the scoring
function run over tensors derived from megatron-layout parameters gives the log-probs, entropies and (mapped back to
megatron's layout) gradients that the FSDP backend's prepared HF model gives, bit for bit. Both sides run the same
module code on the same values (the derivation only slices, splits and reshapes), so equality is exact, not a
tolerance. megatron-core itself runs on GPU machines only (tests/backends/megatron/test_megatron_exact_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_model_dir
from polyrl.backends import true_on_policy as tp
from polyrl.backends.megatron import bridge
from polyrl.backends.megatron.exact import ExactForward, problem


def _hf(path: str):
    from transformers import AutoModelForCausalLM
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=tp.register_attention())
    return tp.prepare(lm, torch.float32)


def _sequences(vocab: int) -> list[tuple[torch.Tensor, int]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(1, vocab, (n,), generator=g), p) for n, p in ((9, 4), (17, 6), (5, 1), (30, 12))]


def _loss(logp: torch.Tensor, ent: torch.Tensor) -> torch.Tensor:
    w = torch.linspace(-1.0, 1.0, logp.numel())
    return (logp * w).sum() + 0.1 * ent.sum()


@pytest.mark.parametrize("arch,tied", [("qwen2", True), ("qwen3", True), ("llama", False)])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_scoring_over_megatron_parameters_equals_the_hf_model(tmp_path, arch, tied, checkpointing):
    tp.pin_threads("cpu")
    path = make_model_dir(tmp_path / arch, arch=arch, hidden=64, layers=2, tied=tied)
    hf = _hf(path)
    cfg = hf.config
    # megatron's layout (fused q/k/v per group, [gate; up] fc1, a vocabulary padded to 128 rows) as leaf parameters
    mc = {n: torch.nn.Parameter(t.detach().clone()) for n, t in bridge.hf_to_mcore(hf.state_dict(), cfg).items()}
    assert any(n.endswith("linear_qkv.weight") for n in mc) and mc["embedding.word_embeddings.weight"].shape[0] % 128 == 0
    seqs = _sequences(cfg.vocab_size)

    with tp.invariant():
        want, want_ent = tp.sequences_logprobs(hf, seqs, temperature=0.7, with_entropy=True)
    _loss(want, want_ent).backward()

    fwd = ExactForward(cfg, torch.float32, torch.device("cpu"), checkpointing=checkpointing)
    with tp.invariant():
        got, got_ent = fwd(mc.items(), seqs, temperature=0.7, with_entropy=True, training=True)
    assert torch.equal(got, want) and torch.equal(got_ent, want_ent), (got - want).abs().max()
    _loss(got, got_ent).backward()
    fwd.release()
    assert all(p.is_meta for p in fwd.lm.parameters())  # nothing of megatron's held between passes

    # the HF gradients in megatron's layout (the tied head's gradient is part of the embedding's), bit for bit
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    if tied:
        assert "lm_head.weight" not in hf_grads
    want_grads = bridge.hf_to_mcore(hf_grads, cfg)
    assert set(want_grads) == set(mc)
    for n, p in mc.items():
        assert p.grad is not None, n
        assert torch.equal(p.grad, want_grads[n]), (n, (p.grad - want_grads[n]).abs().max())

    # a no-grad pass (the log-prob pass) binds frozen tensors and gives the same values
    with torch.no_grad(), tp.invariant():
        again, _ = fwd(mc.items(), seqs, temperature=0.7, with_entropy=False)
    assert torch.equal(again, want)
    fwd.release()


def test_a_tokens_value_does_not_depend_on_the_micro_batch(tmp_path):
    """The same sequences split into other micro-batches: every token's log-prob keeps its bits (the mode's batch
    invariance holds through the megatron-layout derivation too)."""
    tp.pin_threads("cpu")
    path = make_model_dir(tmp_path / "m", arch="qwen2", hidden=64, layers=2)
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(path)
    mc = bridge.hf_to_mcore(_hf(path).state_dict(), cfg)
    seqs = _sequences(cfg.vocab_size)
    fwd = ExactForward(cfg, torch.float32, torch.device("cpu"))
    with torch.no_grad(), tp.invariant():
        whole, _ = fwd(mc.items(), seqs, temperature=1.0, with_entropy=False)
        parts = [fwd(mc.items(), [s], temperature=1.0, with_entropy=False)[0] for s in seqs]
        pairs = [fwd(mc.items(), seqs[i:i + 2], temperature=1.0, with_entropy=False)[0] for i in (0, 2)]
    assert torch.equal(torch.cat(parts), whole) and torch.equal(torch.cat(pairs), whole)


def test_settings_the_megatron_shell_cannot_run_are_named(tmp_path):
    import dataclasses

    from transformers import AutoConfig

    from polyrl.config import MegatronConfig
    cfg = AutoConfig.from_pretrained(make_model_dir(tmp_path / "m", arch="qwen2"))
    mg = MegatronConfig()
    assert problem(cfg, mg) is None

    def why(**kw) -> str:
        return problem(cfg, dataclasses.replace(mg, **kw))
    assert "--tensor-model-parallel-size 2" in why(tensor_model_parallel_size=2)
    assert "--pipeline-model-parallel-size 2" in why(pipeline_model_parallel_size=2)
    assert "--context-parallel-size 2" in why(context_parallel_size=2)
    assert "--expert-model-parallel-size 2" in why(expert_model_parallel_size=2)
    assert "--sequence-parallel" in why(sequence_parallel=True)
    assert "--use-megatron-fsdp" in why(use_megatron_fsdp=True)
    assert "--recompute-granularity selective" in why(recompute_granularity="selective")
    assert "--custom-model-provider-path" in why(custom_model_provider_path="m.py:f")
    moe = AutoConfig.for_model("qwen3_moe", num_hidden_layers=1, hidden_size=32, num_attention_heads=2)
    assert "'qwen3_moe'" in problem(moe, mg)
