"""Qwen3-VL's Megatron pieces without megatron (polyrl/backends/megatron/vision.py), on CPU, against the HF Qwen3-VL model
itself: the checkpoint names through the bridge (as Qwen3) and back, the interleaved multimodal RoPE tables, the
deepstack addition (HF's _deepstack_process) and the layer hooks that apply it, on a tiny Qwen3-VL whose deepstack
features go into decoder layers 0 and 1 of 3 (test_megatron_vlm_gpu.build_vl, the model of the GPU parity test)."""

from __future__ import annotations

import copy
import types

import pytest
import torch

from polyrl.backends.megatron import bridge, thd, vision
from polyrl.multimodal import mrope_positions
from test_megatron_vlm_gpu import build_vl

from conftest import image_batch


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3_vl_mg"))
    model, proc = build_vl(path, "qwen3_vl")
    assert model.config.vision_config.deepstack_visual_indexes == [0, 1]
    assert model.config.text_config.num_hidden_layers == 3
    return path, model, proc


def test_qwen3_vl_is_supported_on_one_rank_and_the_rest_is_refused():
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig
    vision.check_supported(Qwen3VLConfig())
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 2"):
        vision.check_supported(Qwen3VLConfig(), tp=2)
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size 2"):
        vision.check_supported(Qwen3VLConfig(), pp=2)
    with pytest.raises(ValueError, match=r"'qwen3_vl_moe' is not supported; supported: \['qwen2_5_vl', 'qwen3_vl'\]"):
        vision.check_supported(Qwen3VLMoeConfig())


def test_checkpoint_names_through_the_bridge_and_back_are_exact(vl):
    _, model, _ = vl
    cfg = model.config
    hf = {n: t.detach().clone() for n, t in model.state_dict().items()}
    tcfg = vision.text_config(cfg)
    assert tcfg.model_type == "qwen3" and tcfg.tie_word_embeddings == cfg.tie_word_embeddings
    assert bridge.config_to_mcore_kwargs(tcfg)["qk_layernorm"]
    sd = bridge.hf_to_mcore(vision.TextCheckpoint(hf), tcfg)
    assert torch.equal(sd["decoder.layers.2.self_attention.q_layernorm.weight"],
                       hf["model.language_model.layers.2.self_attn.q_norm.weight"])
    tower = vision.build_tower(cfg, torch.float32, "cpu")
    assert type(tower).__name__ == "Qwen3VLVisionModel"
    vision.load_tower(tower, hf)
    stream = [("module." + n, t) for n, t in sd.items()] + [("module." + vision.PREFIX + n, p.detach())
                                                             for n, p in tower.named_parameters()]
    out = dict(vision.export_hf(stream, lambda s: bridge.mcore_to_hf(s, tcfg)))
    assert set(out) == {n for n, _ in model.named_parameters()}  # the tied lm_head is no parameter
    assert any(".deepstack_merger_list.1." in n for n in out)
    for n, t in out.items():
        assert torch.equal(t, hf[n]), n


def test_interleaved_mrope_tables_equal_hf_rotary(vl):
    """The tables polyrl applies equal HF's Qwen3-VL rotary at the same 3-D positions, bit for bit (the same fp32
    products and cos / sin; only the order of recomposing and taking cos differs, elementwise). Random positions, so
    time, height and width differ everywhere, and the contiguous (Qwen2-VL) assignment would differ."""
    _, model, _ = vl
    cfg = model.config
    rope = vision.MropeRope(cfg, torch.float32, "cpu")
    assert rope.interleaved and rope.section == [4, 2, 2]
    pos = torch.randint(0, 200, (3, 50), generator=torch.Generator().manual_seed(0))
    cos, sin = rope.tables(pos)
    x = torch.empty(0)
    hc, hs = model.model.language_model.rotary_emb(x, pos[:, None])
    assert torch.equal(cos[:, 0], hc[0]) and torch.equal(sin[:, 0], hs[0])
    text = rope.tables(pos[0])  # 1-D positions: every axis the same, any assignment gives the plain RoPE table
    assert torch.equal(text[0][:, 0], model.model.language_model.rotary_emb(x, pos[0].expand(3, 1, -1))[0][0])
    rope.interleaved = False
    assert not torch.allclose(rope.tables(pos)[0], cos)


def test_add_deepstack_equals_hf_deepstack_process(vl):
    _, model, _ = vl
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, 9, 64, generator=g)
    mask = torch.tensor([0, 1, 1, 0, 0, 1, 0, 1, 0], dtype=torch.bool)
    e = torch.randn(4, 64, generator=g)
    want = model.model.language_model._deepstack_process(h, mask[None], e)
    assert torch.equal(vision.add_deepstack(h, mask, e), want)  # HF's [1, T, H]
    assert torch.equal(vision.add_deepstack(h[0][:, None], mask, e)[:, 0], want[0])  # megatron's [T, 1, H]


class _Chunk(torch.nn.Module):
    """What the hooks and decoder_input read of a first-stage GPTModel: vision_model, config, decoder.layers."""

    def __init__(self, tower, layers, recompute=None):
        super().__init__()
        self.vision_model = tower
        self.config = types.SimpleNamespace(recompute_granularity=recompute)
        self.decoder = types.SimpleNamespace(layers=layers)


@torch.no_grad()
def test_packed_forward_with_deepstack_hooks_equals_the_hf_forward_per_sample(vl):
    """What the Megatron forward does, rebuilt with HF's own decoder layers: the packed micro-batch's embedding rows,
    decoder_input (merged features into the pads, deepstack features left for the hooks), attach_deepstack's hooks on
    layers 0 and 1, the packed 3-D positions and interleaved tables, one forward over the whole packing; each
    sample's logits against its own plain HF forward. The same fp32 ops in another order of rows (packing): 1e-4 on
    logits of size ~1. Without the hooks' additions the logits move by far more."""
    _, model, proc = vl
    model = copy.deepcopy(model)  # the hooks stay on these layers
    cfg = model.config
    batch = image_batch(proc, n=4)
    ids, mms = batch.input_ids, batch.multimodal
    pb = thd.pack_thd(ids, batch.prompt_lens)
    lm = model.model.language_model
    tower = vision.build_tower(cfg, torch.float32, "cpu")
    vision.load_tower(tower, model.state_dict())
    chunk = _Chunk(tower, lm.layers)
    vision.attach_deepstack(chunk, cfg)
    state = getattr(chunk, vision.DEEPSTACK)
    rim = vision.rope_index_model(cfg)
    pos3 = vision.packed_positions([mrope_positions(rim, x, m["image_grid_thw"] if m else None, cfg.image_token_id)
                                    for x, m in zip(ids, mms)], pb.cu_seqlens)
    pos4 = torch.cat([pb.position_ids[None], pos3])[:, None]  # HF reads the boundaries from row 0 (without a cache)
    vis = {"pixel_values": torch.cat([m["pixel_values"] for m in mms if m]),
           "image_grid_thw": torch.cat([m["image_grid_thw"] for m in mms if m])}
    emb = lm.embed_tokens(pb.input_ids)[:, None]
    merged = vision.decoder_input(chunk, emb, pb.input_ids, vis, cfg.image_token_id)
    assert len(state.embeds) == 2 and int(state.mask.sum()) == state.embeds[0].shape[0]
    got = model.lm_head(lm(inputs_embeds=merged[:, 0][None], position_ids=pos4, use_cache=False).last_hidden_state)[0]
    assert state.mask is None and state.embeds == []  # layer 1's hook let go of them
    # the hooks now add nothing (and the reference forwards below run HF's own deepstack alone)
    plain = model.lm_head(lm(inputs_embeds=merged[:, 0][None], position_ids=pos4, use_cache=False).last_hidden_state)[0]
    offs = [int(x) for x in pb.cu_seqlens]
    for k, (x, mm) in enumerate(zip(ids, mms)):
        kw = {} if mm is None else {**mm, "mm_token_type_ids": (x == cfg.image_token_id).int()[None]}
        ref = model(input_ids=x[None], **kw).logits[0]
        sl = slice(offs[k], offs[k] + x.numel())
        assert (got[sl] - ref).abs().max() < 1e-4, k
        if mm is not None:
            assert (plain[sl] - ref).abs().max() > 1e-2, k


def test_text_only_micro_batch_adds_nothing_and_reaches_every_vision_parameter(vl):
    _, model, _ = vl
    tower = vision.build_tower(model.config, torch.float32, "cpu")
    vision.load_tower(tower, model.state_dict())
    layers = torch.nn.ModuleList([torch.nn.Identity() for _ in range(3)])
    chunk = _Chunk(tower, layers)
    vision.attach_deepstack(chunk, model.config)
    emb = torch.randn(5, 1, 64, requires_grad=True)
    out = vision.decoder_input(chunk, emb, torch.arange(5), {}, model.config.image_token_id)
    assert getattr(chunk, vision.DEEPSTACK).mask is None and torch.equal(layers[0](out), emb)
    out.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in tower.parameters())
    assert any(n.startswith("deepstack_merger_list.") for n, _ in tower.named_parameters())


def test_deepstack_refuses_full_recompute_and_is_off_without_deepstack(vl, tmp_path):
    _, model, _ = vl
    layers = torch.nn.ModuleList([torch.nn.Identity()])
    with pytest.raises(ValueError, match="--recompute-granularity full"):
        vision.attach_deepstack(_Chunk(None, layers, recompute="full"), model.config)
    from transformers import Qwen2_5_VLConfig
    chunk = _Chunk(None, layers, recompute="full")
    vision.attach_deepstack(chunk, Qwen2_5_VLConfig())  # no deepstack: nothing to hook, nothing refused
    assert not hasattr(chunk, vision.DEEPSTACK) and not layers[0]._forward_hooks
