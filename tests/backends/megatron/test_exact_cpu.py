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
    return tp.prepare(lm)


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


def test_the_megatron_plan_in_the_mode_pads_to_fewer_blocks_and_carries_each_sample(monkeypatch):
    """MegatronBackend._plan (its pure part: no megatron-core, one rank) with --true-on-policy and a token budget: as
    many micro-batches as the token-balanced plan, padded to fewer whole blocks (fewer_blocks: 8 samples of 36 tokens
    in a 192-token budget pad to 5 blocks of 64 rows, not 6), each carrying its samples as (ids, prompt length) in
    the order of its packed batch's response tokens."""
    import types

    import torch.distributed as dist

    from polyrl.backends.base import padded_blocks
    from polyrl.backends.megatron.backend import MegatronBackend
    from polyrl.config import BatchConfig
    from polyrl.types import TrainBatch
    one = types.SimpleNamespace(get_data_parallel_world_size=lambda: 1, get_data_parallel_rank=lambda: 0,
                                get_context_parallel_world_size=lambda: 1, get_context_parallel_rank=lambda: 0)
    monkeypatch.setattr(MegatronBackend, "ps", property(lambda self: one))
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 1)
    be = object.__new__(MegatronBackend)
    be.bcfg = BatchConfig(use_dynamic_batch_size=True, max_tokens_per_gpu=192)
    be.device, be.vpp, be.routing, be.vl_config = torch.device("cpu"), None, None, None
    be.dims = types.SimpleNamespace(tp=1, pp=1)
    be.config = types.SimpleNamespace(sequence_parallel=False)
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(1, 50, (36,), generator=g) for _ in range(8)]
    glob = TrainBatch(ids, [10 + i for i in range(8)], {"loss_mask": [torch.ones(26 - i) for i in range(8)]})
    lens = [36] * 8
    for exact in (None, object()):
        be.exact = exact
        micros = be._plan(glob)
        plans = [m.index for m in micros]
        assert len(plans) == 2 and sorted(i for p in plans for i in p) == list(range(8))
        assert padded_blocks(plans, lens, 64) == (6 if exact is None else 5)
        for m in micros:
            if exact is None:
                assert m.sequences is None
                continue
            assert [(x.tolist(), p) for x, p in m.sequences] == [(ids[i].tolist(), 10 + i) for i in m.index]
            assert m.pb.response_lens == [int(x.numel()) - p for x, p in m.sequences]
