"""The Megatron backend's vision-language pieces without megatron (polyrl/backends/megatron/vision.py): the checkpoint
names through the bridge and back, the image-feature merge, the packed 3-D positions and the multimodal RoPE tables,
against the HF Qwen2.5-VL model itself, on CPU."""

from __future__ import annotations

import random

import pytest
import torch

from polyrl.backends.megatron import bridge, thd, vision
from polyrl.multimodal import mrope_positions
from polyrl.tasks import counting

PROMPT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "how many red squares?"}]}]


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_5_vl_mg")
    model, proc = counting.build_model(str(path), arch="qwen2_5_vl")
    with torch.no_grad():  # random norms and biases, so a misplaced tensor changes the output
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    model.eval()
    return str(path), model, proc


def _samples(proc, n: int):
    rng = random.Random(0)
    out = []
    for k in range(n):
        img = counting.draw_board(counting.make_board(rng)[0])
        ids, mm = proc.encode(PROMPT, [img])
        ids = torch.tensor(ids + [5, 6, 7][: k + 1])
        out.append((ids, mm))
    return out


def test_refusals_name_the_flag():
    from transformers import Qwen2_5_VLConfig, Qwen3VLMoeConfig
    vision.check_supported(Qwen2_5_VLConfig())
    with pytest.raises(ValueError, match="'qwen3_vl_moe' is not supported.*--train-backend fsdp"):
        vision.check_supported(Qwen3VLMoeConfig())
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 2"):
        vision.check_supported(Qwen2_5_VLConfig(), tp=2)
    with pytest.raises(ValueError, match="--lora-rank"):
        vision.check_supported(Qwen2_5_VLConfig(), lora=True)
    with pytest.raises(ValueError, match="--use-megatron-fsdp"):
        vision.check_supported(Qwen2_5_VLConfig(), megatron_fsdp=True)


def test_checkpoint_names_through_the_bridge_and_back_are_exact(vl):
    _, model, _ = vl
    cfg = model.config
    hf = {n: t.detach().clone() for n, t in model.state_dict().items()}
    tcfg = vision.text_config(cfg)
    assert tcfg.model_type == "qwen2" and tcfg.tie_word_embeddings == cfg.tie_word_embeddings
    sd = bridge.hf_to_mcore(vision.TextCheckpoint(hf), tcfg)
    assert sd and not any(k.startswith(vision.PREFIX) for k in sd)
    tower = vision.build_tower(cfg, torch.float32, "cpu")
    vision.load_tower(tower, hf)
    for n, p in tower.named_parameters():
        assert torch.equal(p, hf["model.visual." + n]), n
    # the stream a first-stage chunk exports: decoder parameters, then the tower's (megatron's wrappers' prefixes on)
    stream = [("module." + n, t) for n, t in sd.items()] + [("module." + vision.PREFIX + n, p.detach())
                                                             for n, p in tower.named_parameters()]
    out = dict(vision.export_hf(stream, lambda s: bridge.mcore_to_hf(s, tcfg)))
    want = {n for n, _ in model.named_parameters()}  # in-memory names; the tied lm_head is not a parameter
    assert set(out) == want
    for n, t in out.items():
        assert torch.equal(t, hf[n]), n


def test_older_checkpoint_layout_reads_the_same(vl):
    path, model, _ = vl
    hf = {n: t for n, t in model.state_dict().items()}
    old = {}
    for n, t in hf.items():  # transformers 4's saved names: model.layers.*, visual.*
        if n.startswith("model.language_model."):
            old["model." + n[len("model.language_model."):]] = t
        elif n.startswith("model.visual."):
            old[n[len("model."):]] = t
        else:
            old[n] = t
    tcfg = vision.text_config(model.config)
    a, b = bridge.hf_to_mcore(vision.TextCheckpoint(hf), tcfg), bridge.hf_to_mcore(vision.TextCheckpoint(old), tcfg)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert vision.vision_state(old).keys() == vision.vision_state(hf).keys()
    saved = bridge.load_hf_safetensors(path)  # what save_pretrained writes (the older names, here)
    assert bridge.hf_to_mcore(vision.TextCheckpoint(saved), tcfg).keys() == a.keys()
    assert vision.vision_state(saved).keys() == vision.vision_state(hf).keys()


@torch.no_grad()
def test_packed_merge_and_mrope_equal_the_hf_forward_per_sample(vl):
    """What the Megatron forward feeds its decoder, rebuilt with HF's own decoder layers: megatron's embedding rows
    (= embed_tokens), the tower's features scattered into the pads, the packed 3-D positions and polyrl's RoPE tables
    applied by thd.apply_rope, against each sample's plain HF forward. Both are the same fp32 ops in another order of
    rows (packing), so logits agree to fp32 rounding: 1e-4 on logits of size ~1."""
    _, model, proc = vl
    cfg = model.config
    samples = _samples(proc, 3)
    ids = [s[0] for s in samples]
    pb = thd.pack_thd(ids, [int(x.numel()) - 1 for x in ids])
    tower = vision.build_tower(cfg, torch.float32, "cpu")
    vision.load_tower(tower, model.state_dict())
    pv = torch.cat([s[1]["pixel_values"] for s in samples])
    grid = torch.cat([s[1]["image_grid_thw"] for s in samples])
    feats = vision.image_features(tower, pv, grid)
    emb = model.model.language_model.embed_tokens(pb.input_ids)[:, None]
    merged = vision.merge_embeddings(emb, pb.input_ids, feats, cfg.image_token_id)
    rim = vision.rope_index_model(cfg)
    pos3 = vision.packed_positions([mrope_positions(rim, x, s[1]["image_grid_thw"], cfg.image_token_id)
                                    for x, s in zip(ids, samples)], pb.cu_seqlens)
    rope = vision.MropeRope(cfg, torch.float32, "cpu")
    cos, sin = rope.tables(pos3)
    lm = model.model.language_model
    offs = [int(x) for x in pb.cu_seqlens]
    for k, (x, mm) in enumerate(samples):
        ref = model(input_ids=x[None], pixel_values=mm["pixel_values"], image_grid_thw=mm["image_grid_thw"],
                    mm_token_type_ids=(x == cfg.image_token_id).int()[None]).logits[0]
        sl = slice(offs[k], offs[k + 1])
        p3 = pos3[:, sl]
        # HF's own rotary at these positions gives the tables polyrl applies
        hc, hs = lm.rotary_emb(merged, p3[:, None])
        assert torch.allclose(cos[sl, 0], hc[0]) and torch.allclose(sin[sl, 0], hs[0])
        q = torch.randn(x.numel(), 4, cfg.text_config.head_dim)
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb
        hq, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], hc, hs)
        assert torch.allclose(thd.apply_rope(q, cos[sl], sin[sl]), hq[0].transpose(0, 1), atol=1e-6)
        pos4 = torch.cat([torch.arange(x.numel())[None], p3])[:, None]
        h = lm(inputs_embeds=merged[sl, 0][None], position_ids=pos4).last_hidden_state
        got = model.lm_head(h)[0]
        assert (got - ref).abs().max() < 1e-4


def test_merge_refuses_a_count_mismatch():
    emb = torch.zeros(4, 1, 2)
    with pytest.raises(ValueError, match="3 image tokens but its images make 2"):
        vision.merge_embeddings(emb, torch.tensor([9, 9, 1, 9]), torch.ones(2, 2), 9)
    out = vision.merge_embeddings(emb, torch.tensor([9, 1, 9, 1]), torch.tensor([[1., 2.], [3., 4.]]), 9)
    assert out[:, 0].tolist() == [[1, 2], [0, 0], [3, 4], [0, 0]]


def test_packed_positions_pad_past_the_largest():
    per = [torch.tensor([[0, 1, 1, 4]] * 3), torch.arange(2).expand(3, -1)]
    out = vision.packed_positions(per, torch.tensor([0, 4, 7]))
    assert out[0].tolist() == [0, 1, 1, 4, 0, 1, 2]


def test_backend_gathers_pixel_inputs_and_packs_3d_positions(vl):
    """The Megatron backend's own data path (no megatron needed): _gather_batch carries each sample's pixel inputs,
    _vision_inputs gives a micro-batch every image in token order and its [3, T] positions; a rank's dummy gets 1-D
    positions and no images."""
    import types

    from polyrl.backends.megatron.backend import MegatronBackend
    from polyrl.dist import init_distributed
    from polyrl.types import TrainBatch

    init_distributed("cpu")
    _, model, proc = vl
    cfg = model.config
    samples = _samples(proc, 3)
    ids = [samples[0][0], torch.tensor([5, 6, 7]), samples[2][0]]  # the middle one text-only
    batch = TrainBatch(ids, [int(x.numel()) - 1 for x in ids], {"loss_mask": [torch.ones(1)] * 3},
                       multimodal=[samples[0][1], None, samples[2][1]])
    fake = types.SimpleNamespace(vl_config=cfg, _rope_index_model=vision.rope_index_model(cfg),
                                 device=torch.device("cpu"))
    glob, counts = MegatronBackend._gather_batch(fake, batch, True)
    assert counts == [3] and [m is None for m in glob.multimodal] == [False, True, False]
    pb = thd.pack_thd(glob.input_ids, glob.prompt_lens)
    vis = MegatronBackend._vision_inputs(fake, glob, pb)
    assert torch.equal(vis["pixel_values"], torch.cat([samples[0][1]["pixel_values"], samples[2][1]["pixel_values"]]))
    assert int((pb.input_ids == cfg.image_token_id).sum()) == int((vis["image_grid_thw"].prod(-1) // 4).sum())
    offs = [int(x) for x in pb.cu_seqlens]
    assert torch.equal(vis["pos3"][:, offs[1]:offs[2]], torch.arange(3).expand(3, -1))
    assert torch.equal(vis["pos3"][:, :offs[1]], mrope_positions(model, glob.input_ids[0],
                                                                   samples[0][1]["image_grid_thw"], cfg.image_token_id))
    dummy = TrainBatch([torch.zeros(2, dtype=torch.long)], [1], {})
    out = MegatronBackend._vision_inputs(fake, dummy, thd.pack_thd(dummy.input_ids, dummy.prompt_lens))
    assert set(out) == {"pos3"} and torch.equal(out["pos3"], torch.arange(2).expand(3, -1))


def test_idle_term_is_zero_and_reaches_every_vision_parameter(vl):
    _, model, _ = vl
    tower = vision.build_tower(model.config, torch.float32, "cpu")
    vision.load_tower(tower, model.state_dict())
    x = torch.randn(5, 1, 8)
    out = x + vision.idle_term(tower)
    assert torch.equal(out, x)
    out.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in tower.parameters())
