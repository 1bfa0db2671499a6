"""LoRA on the Megatron backend, the parts that need no GPU (polyrl/backends/megatron/lora.py): target names, peft's
init, TP sharding of A / B beside the base shards, the merged export through the bridge, the adapter forward with its
TP regions simulated, peft's adapter format (loaded with peft onto the HF model), and the start-up checks.

Tolerances (fp32 on CPU): a merged weight is W + s * (B @ A) on both sides, computed by the same torch ops, so the
export equals HF's merge exactly except where a rank-r product is summed in another order (fused vs per-projection
layout gives the same order: equal). Forward checks compare x @ (s * delta)^T with s * (x @ A^T) @ B^T: the same
products grouped differently, a few ulps of values ~1 (atol 1e-5). A TP2 row-parallel sum adds two partial sums of
the r-dim middle in another order: same bound.
"""

from __future__ import annotations

import json

import pytest
import torch

from polyrl.backends.megatron import bridge, lora
from polyrl.config import ConfigError


@pytest.fixture(scope="module")
def hf(tiny_model):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    return cfg, model


def _full_adapters(cfg, rank: int = 4, seed: int = 3) -> dict[str, torch.Tensor]:
    """Random full adapters (B nonzero, so merges are visible) under global megatron names, every projection."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(cfg.num_hidden_layers):
        for linear, projs in lora.LINEARS.items():
            for p in projs:
                o, i = lora.full_shape(cfg, p)
                key = f"decoder.layers.{layer}.{linear}.lora.{p}."
                out[key + "A"] = torch.randn(rank, i, generator=g) / i ** 0.5
                out[key + "B"] = torch.randn(o, rank, generator=g) * 0.1
    return out


def _hf_merged(model, full: dict, scale: float) -> dict[str, torch.Tensor]:
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for name in list(full):
        if name.endswith(".A"):
            m = lora._ADAPTER.fullmatch(name)
            layer = lora._LAYER.fullmatch(name)[1]
            w = f"model.layers.{layer}.{lora.HF_MODULE[m[2]]}.{m[2]}.weight"
            sd[w] = sd[w] + scale * (full[name[:-1] + "B"] @ full[name])
    return sd


def test_targets_name_megatron_linears_and_refuse_what_has_no_adapter(hf):
    cfg, _ = hf
    assert lora.resolve_targets(cfg, "all-linear") == lora.LINEARS
    assert lora.resolve_targets(cfg, ["q_proj", "v_proj", "down_proj"]) == {
        "self_attention.linear_qkv": ("q_proj", "v_proj"), "mlp.linear_fc2": ("down_proj",)}
    with pytest.raises(ConfigError, match="lm_head has no adapter on --train-backend megatron"):
        lora.resolve_targets(cfg, ["q_proj", "lm_head"])
    from transformers import DeepseekV3Config, Qwen3MoeConfig
    with pytest.raises(ConfigError, match="deepseek_v3 models are not built for LoRA on megatron"):
        lora.resolve_targets(DeepseekV3Config(num_hidden_layers=2), "all-linear")
    moe = Qwen3MoeConfig(num_hidden_layers=2, num_experts=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ConfigError, match="all-linear on a MoE model"):
        lora.resolve_targets(moe, "all-linear")
    with pytest.raises(ConfigError, match="MLPs are experts"):
        lora.resolve_targets(moe, ["q_proj", "up_proj"])
    assert lora.resolve_targets(moe, ["q_proj", "o_proj"]) == {"self_attention.linear_qkv": ("q_proj",),
                                                               "self_attention.linear_proj": ("o_proj",)}


def test_init_is_peft_s_and_the_same_full_adapter_at_every_tp_degree(hf):
    cfg, _ = hf
    a, b = lora.init_adapter(7, 1, "q_proj", 8, lora.full_shape(cfg, "q_proj"))
    a2, _ = lora.init_adapter(7, 1, "q_proj", 8, lora.full_shape(cfg, "q_proj"))
    assert torch.equal(a, a2) and not b.any() and a.shape == (8, cfg.hidden_size)
    assert float(a.abs().max()) <= 1 / cfg.hidden_size ** 0.5  # kaiming_uniform_(a=sqrt(5)): bound 1/sqrt(in)
    assert not torch.equal(a, lora.init_adapter(7, 0, "q_proj", 8, lora.full_shape(cfg, "q_proj"))[0])
    for proj in lora.KIND:
        a, b = torch.randn(4, 6), torch.randn(8, 4)
        if lora.KIND[proj] == "row":
            a = torch.randn(4, 8)
        shards = [lora.shard_adapter(proj, a, b, r, 2) for r in range(2)]
        name = f"decoder.layers.0.x.lora.{proj}."
        assert torch.equal(lora.gather_adapter(name + "A", [s[0] for s in shards]), a)
        assert torch.equal(lora.gather_adapter(name + "B", [s[1] for s in shards]), b)
        split = [s[0 if lora.KIND[proj] == "row" else 1] for s in shards]
        assert not torch.equal(split[0], split[1])  # the split one really differs per rank


@pytest.mark.parametrize("tp", [1, 2])
def test_merged_export_equals_hf_merge_at_tp(hf, tp):
    """Each TP rank merges its own shard (W_r + s * delta_r); the bridge's gather and HF names then give W + s * B @ A of
    every projection: what FSDP's peft export sends."""
    cfg, model = hf
    full, scale = _full_adapters(cfg), 2.0
    want = _hf_merged(model, full, scale)
    rows, groups = lora.local_rows_for(cfg, tp)
    ranks = []
    for r in range(tp):
        named = dict(bridge.hf_to_mcore(model.state_dict(), cfg, tp_rank=r, tp_size=tp))
        for name in list(full):
            if name.endswith(".A"):
                proj = lora._ADAPTER.fullmatch(name)[2]
                a, b = lora.shard_adapter(proj, full[name], full[name[:-1] + "B"], r, tp)
                named[name], named[name[:-1] + "B"] = a, b
        ranks.append(lora.MergedParams(named, scale, rows, groups))
    assert not any(lora.is_adapter(n) for n in ranks[0])
    stream = ((n, bridge.gather_from_tp(n, [m[n] for m in ranks], cfg)) for n in ranks[0])
    got = dict(bridge.mcore_to_hf(stream, cfg))
    assert set(got) == set(want) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    for k in got:
        assert torch.allclose(got[k], want[k], rtol=0, atol=1e-6), k
    assert not torch.equal(got["model.layers.0.self_attn.k_proj.weight"], model.state_dict()["model.layers.0.self_attn.k_proj.weight"])


@pytest.mark.parametrize("targets", [("q_proj", "k_proj", "v_proj"), ("v_proj",), ("gate_proj", "up_proj"), ("up_proj",),
                                     ("o_proj",), ("down_proj",)])
def test_adapter_forward_is_the_merged_delta_at_tp1_and_tp2(hf, targets):
    """adapter_forward(x) == x @ (s * delta)^T for the local delta; at TP2 a column linear's ranks give the row shards
    of the TP1 output (the fused layout of their own groups) and a row linear's partial middles sum to TP1's."""
    cfg, _ = hf
    full, scale = _full_adapters(cfg), 0.5
    linear = next(lin for lin, projs in lora.LINEARS.items() if targets[0] in projs)
    key = f"decoder.layers.0.{linear}.lora."
    pairs = {p: (full[key + p + ".A"], full[key + p + ".B"]) for p in targets}
    in_f = lora.full_shape(cfg, targets[0])[1]
    x = torch.randn(5, 2, in_f, generator=torch.Generator().manual_seed(0))
    rows1, g1 = lora.local_rows_for(cfg, 1)
    y1 = lora.adapter_forward(linear, x, pairs, scale, rows1, g1)
    delta1 = lora.local_delta(linear, pairs, rows1, g1)
    torch.testing.assert_close(y1, x @ (scale * delta1).t(), rtol=0, atol=1e-5)
    rows2, g2 = lora.local_rows_for(cfg, 2)
    shards = [{p: lora.shard_adapter(p, a, b, r, 2) for p, (a, b) in pairs.items()} for r in range(2)]
    if lora.KIND[targets[0]] == "col":
        ys = [lora.adapter_forward(linear, x, s, scale, rows2, g2) for s in shards]
        name = f"decoder.layers.0.{linear}.weight"  # the bridge joins TP outputs' rows as it joins weight rows
        joined = bridge.gather_from_tp(name, [y.reshape(-1, y.shape[-1]).t() for y in ys], cfg).t().reshape(y1.shape)
        torch.testing.assert_close(joined, y1, rtol=0, atol=1e-5)
    else:
        xs = x.chunk(2, dim=-1)
        parts = [lora.adapter_forward(linear, xs[r], shards[r], scale, rows2, g2) for r in range(2)]
        torch.testing.assert_close(parts[0] + parts[1], y1, rtol=0, atol=1e-5)  # row_mid sums before B: linear in B


def test_adapter_forward_trains_a_and_b_like_the_merged_weight(hf):
    """Gradients through adapter_forward equal those of x @ (W + s * B @ A)^T with respect to A and B."""
    cfg, _ = hf
    full = _full_adapters(cfg)
    key = "decoder.layers.1.self_attention.linear_qkv.lora."
    rows, g = lora.local_rows_for(cfg, 1)
    pairs = {p: (full[key + p + ".A"].clone().requires_grad_(), full[key + p + ".B"].clone().requires_grad_())
             for p in ("q_proj", "k_proj")}
    x = torch.randn(3, 1, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    lora.adapter_forward("self_attention.linear_qkv", x, pairs, 2.0, rows, g).pow(2).sum().backward()
    got = [t.grad.clone() for ab in pairs.values() for t in ab]
    for ab in pairs.values():
        for t in ab:
            t.grad = None
    (x @ (2.0 * lora.local_delta("self_attention.linear_qkv", pairs, rows, g)).t()).pow(2).sum().backward()
    # FP32 in two association orders, (x A^T) B^T against x (B A)^T: each gradient element sums ~hidden products whose
    # partial sums reach ~1e-1, so the orders differ by a few ulps of those (~1e-6 seen); 1e-5 absolute leaves 10x
    for a, b in zip(got, [t.grad for ab in pairs.values() for t in ab]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_peft_adapter_directory_loads_onto_the_hf_model(hf, tmp_path, tiny_model):
    """--save-hf-adapter's files: peft names, adapter_config.json; PeftModel.from_pretrained on the base model gives
    the merged weights, and the names map back (from_peft) to the megatron parameters, also from peft's in-memory
    `lora_A.default.weight`."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM
    cfg, model = hf
    full, rank, alpha = _full_adapters(cfg), 4, 8
    tensors = dict(lora.stream_to_peft(full.items()))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in tensors
    conf = lora.adapter_config(rank, alpha, 0.0, list(lora.KIND), tiny_model)
    lora.write_peft_dir(str(tmp_path / "ad"), tensors, conf)
    assert json.load(open(tmp_path / "ad" / "adapter_config.json"))["r"] == rank
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(base, str(tmp_path / "ad"))
    mem = {k: v for k, v in pm.state_dict().items() if ".lora_" in k}
    assert len(mem) == len(full)
    for k, v in mem.items():
        assert torch.equal(v, full[lora.from_peft(k)]), k
    merged = pm.merge_and_unload().state_dict()
    want = _hf_merged(model, full, alpha / rank)
    for k, v in want.items():
        torch.testing.assert_close(merged[k], v, rtol=0, atol=1e-6)
    assert lora.from_peft("model.layers.0.self_attn.q_proj.weight") is None
    # the FSDP backend's in-memory names (its HF module under `lm.`), as the GPU parity test reads them
    assert lora.from_peft("lm.model.layers.3.mlp.up_proj.lora_B.default.weight") == \
        "decoder.layers.3.mlp.linear_fc1.lora.up_proj.B"


def test_megatron_takes_lora_flags_and_refuses_megatron_fsdp(tiny_model, arith_data, capsys):
    from polyrl.capabilities import refuse_unhonoured
    from polyrl.cli import main
    from polyrl.config import Config
    cfg = Config()
    cfg.cluster.train_backend = "megatron"
    cfg.model.lora_rank, cfg.model.lora_target_modules = 8, "q_proj,v_proj"
    cfg.checkpoint.save_hf_adapter = True
    refuse_unhonoured(cfg, "train")  # no ConfigError: megatron honours the --lora-* flags now
    base = ["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--rm-type", "arithmetic",
            "--train-backend", "megatron", "--lora-rank", "4"]
    assert main(base + ["--use-megatron-fsdp"]) == 2
    assert "--lora-rank with --use-megatron-fsdp" in capsys.readouterr().err


def test_tp_that_splits_a_query_group_is_refused(hf):
    cfg, _ = hf
    with pytest.raises(ConfigError, match="KV heads do not split over TP"):
        lora.local_rows_for(cfg, 4)
