"""The colocated direct copy (polyrl.weight_sync.direct): trainer tensors cast and written into the GPU engine's flat
weight buffer by one multi-tensor copy per group instead of name by name. Run here on the engine's CPU layout; the
CUDA path through the FSDP backend is in tests/rollout/test_gpu_engine.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from conftest import make_model_dir
from polyrl.rollout.gpu.model import DenseLM, spec_from_config
from polyrl.weight_sync.direct import plan_groups


def _model(tmp_path, arch: str, **kw) -> DenseLM:
    cfg = AutoConfig.from_pretrained(make_model_dir(tmp_path, arch=arch, **kw))
    return DenseLM(spec_from_config(cfg)[0], torch.device("cpu"), torch.bfloat16)


def _hf_tensors(m: DenseLM, seed: int = 0) -> dict[str, torch.Tensor]:
    """An FP32 'trainer' tensor for every HF name the engine stores once (stacked experts, not their per-expert
    aliases; a tied LM head is the embedding)."""
    g = torch.Generator().manual_seed(seed)
    aliases = {n for parts in m.parts.values() for n in parts} | ({"lm_head.weight"} if m.spec.tied else set())
    return {n: torch.randn(v.shape, generator=g) for n, v in m.hf.items() if n not in aliases}


def _groups(names: list[str]) -> list[list[str]]:
    """FSDP-like units: one per decoder layer, the rest in a root unit."""
    layers: dict[str, list[str]] = {}
    for n in names:
        key = ".".join(n.split(".")[:3]) if n.startswith("model.layers.") else "root"
        layers.setdefault(key, []).append(n)
    return list(layers.values())


@pytest.mark.parametrize("arch,tied", [("qwen2", False), ("qwen3", True), ("llama", True), ("qwen3_moe", False)])
def test_direct_copy_writes_every_weight_bit_exact_in_few_runs(tmp_path, arch, tied):
    """Every engine weight equals the trainer's tensor cast to the engine dtype (a cast is exact and deterministic,
    so equality is bitwise); each decoder layer is one contiguous run, padding between weights is left untouched."""
    m = _model(tmp_path, arch, tied=tied)
    m.flat.fill_(7.0)  # padding and anything not written keeps 7
    src = _hf_tensors(m)
    groups = _groups(list(src))
    plans = plan_groups([[(n, src[n].shape) for n in g] for g in groups], m.hf)
    for g, plan in zip(groups, plans):
        plan.write([src[n].reshape(-1) for n in g], m.hf)
    for n, t in src.items():
        assert torch.equal(m.hf[n], t.to(torch.bfloat16)), n
    if m.spec.tied:
        assert m.hf["lm_head.weight"].data_ptr() == m.hf["model.embed_tokens.weight"].data_ptr()
    written = torch.zeros(m.numel, dtype=torch.bool)
    for v in {id(v): v for v in m.w.values()}.values():
        start = v.data_ptr() // 2 - m.flat.data_ptr() // 2
        written[start:start + v.numel()] = True
    assert not (m.flat[written] == 7.0).any()  # every weight element was written
    assert (m.flat[~written] == 7.0).all()  # padding (inside a run or not) is not written
    layer_plans = [p for g, p in zip(groups, plans) if g[0].startswith("model.layers.")]
    assert all(len(p.runs) == 1 and not p.loose for p in layer_plans)
    assert len(plans) == len(groups)


def test_a_gap_holding_another_weight_is_left_alone(tmp_path):
    """A group writing q_proj and v_proj but not k_proj (between them in the fused qkv rows) must leave k alone."""
    m = _model(tmp_path, "qwen2")
    m.flat.fill_(3.0)
    a = "model.layers.0.self_attn."
    src = {n: torch.randn(m.hf[n].shape) for n in (a + "q_proj.weight", a + "v_proj.weight")}
    (plan,) = plan_groups([[(n, t.shape) for n, t in src.items()]], m.hf)
    plan.write([t.reshape(-1) for t in src.values()], m.hf)
    assert len(plan.runs) == 1  # one region split around k_proj, whose piece is not written
    assert (m.hf[a + "k_proj.weight"] == 3.0).all()
    for n, t in src.items():
        assert torch.equal(m.hf[n], t.to(torch.bfloat16))


def test_per_expert_sources_and_bad_names_or_shapes(tmp_path):
    """A checkpoint-style stream (per-expert names) fills the stacked expert buffers too; an unknown name or a wrong
    shape fails at planning with the engine's own messages, before anything is written."""
    m = _model(tmp_path, "qwen3_moe")
    e = "model.layers.0.mlp.experts."
    names = [n for n in m.hf if n.startswith(e) and n[len(e)].isdigit()]
    src = {n: torch.randn(m.hf[n].shape) for n in names}
    (plan,) = plan_groups([[(n, t.shape) for n, t in src.items()]], m.hf)
    plan.write([t.reshape(-1) for t in src.values()], m.hf)
    for n, t in src.items():
        assert torch.equal(m.hf[n], t.to(torch.bfloat16))
    with pytest.raises(KeyError, match="which the rollout model does not have"):
        plan_groups([[("model.nope.weight", torch.Size([2]))]], m.hf)
    with pytest.raises(ValueError, match="got shape"):
        plan_groups([[(e + "gate_up_proj", torch.Size([1, 2]))]], m.hf)
