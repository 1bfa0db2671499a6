"""Image prompts through data, the embedded engine and the FSDP backend, on tiny Qwen2.5-VL / Qwen3-VL models built from
configs (polyrl.tasks.counting), on CPU."""

from __future__ import annotations

import base64
import io
import json
import random

import pytest
import torch

from polyrl.data import DataError, PromptDataset, load_records, load_sft_records
from polyrl.multimodal import VisionProcessor, image_data_url
from polyrl.tasks import counting
from polyrl.types import SamplingParams

from conftest import image_batch  # test_multimodal_gpu imports it from here too

PROMPT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "how many red squares? answer:"}]}]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def vl_model(request, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp(request.param)
    counting.build_model(str(path), arch=request.param)
    return str(path)


@pytest.fixture(scope="module")
def qwen25_vl(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen2_5_vl_one")
    counting.build_model(str(path), arch="qwen2_5_vl")
    return str(path)


def boards(n: int, seed: int = 0):
    rng = random.Random(seed)
    return [counting.draw_board(counting.make_board(rng)[0]) for _ in range(n)]


def _png_b64(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


# ---- data -------------------------------------------------------------------------------------------------------------
def test_rows_with_image_paths_data_urls_and_base64(tmp_path, qwen25_vl):
    a, b, c = boards(3)
    (tmp_path / "img").mkdir()
    a.save(tmp_path / "img" / "a.png")
    rows = [{"prompt": PROMPT, "label": "1", "images": ["img/a.png"]},
            {"prompt": "<image>how many red squares? answer:", "label": "2", "images": [image_data_url(b)]},
            {"prompt": PROMPT, "label": "3", "images": [_png_b64(c)]}]
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recs = load_records(str(p), multimodal_keys={"image": "images"})
    assert recs[0].images == [str(tmp_path / "img" / "a.png")]  # relative to the data file, not the working directory
    proc = VisionProcessor.from_pretrained(qwen25_vl)
    ds = PromptDataset(recs, proc.tokenizer, shuffle=False, processor=proc)
    for (ids, rec), img in zip(ds.items, (a, b, c)):
        want, mm = proc.encode(PROMPT, [img])
        assert ids == want  # the <image> marker and the content part render the same prompt
        # 32 x 32 pixels in 8-pixel patches, merged 2 x 2: 4 image tokens
        assert ids.count(proc.image_token_id) == 4 and mm["image_grid_thw"].tolist() == [[1, 4, 4]]


@pytest.mark.parametrize("case,images,match", [
    ("missing", ["nope.png"], r"d\.jsonl:1: images\[0\]: image file .*nope\.png does not exist"),
    ("unreadable", ["bad.png"], r"d\.jsonl:1: images\[0\]: image .*bad\.png is unreadable"),
    ("more", ["ok.png", "ok.png"], r"d\.jsonl:1: 2 image\(s\) but 1 image placeholder\(s\).*more images than"),
    ("fewer", [], r"d\.jsonl:1: 0 image\(s\) but 1 image placeholder"),
    ("not a list", 3, r"d\.jsonl:1: 'images' must be a list"),
])
def test_bad_image_rows_name_the_file_and_row(tmp_path, case, images, match):
    boards(1)[0].save(tmp_path / "ok.png")
    (tmp_path / "bad.png").write_bytes(b"not a png")
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"prompt": PROMPT, "response": "1", "images": images}) + "\n")
    with pytest.raises(DataError, match=match):
        load_records(str(p), multimodal_keys={"image": "images"})
    with pytest.raises(DataError, match=match):
        load_sft_records(str(p), multimodal_keys={"image": "images"})


def test_image_row_without_the_column_names_the_flag(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"prompt": PROMPT}) + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl:1: row has no key 'pics'.*--multimodal-keys"):
        load_records(str(p), multimodal_keys={"image": "pics"})


def test_multimodal_keys_flag_is_checked_at_start_up():
    from polyrl.config import Config, ConfigError, validate
    cfg = Config()
    cfg.data.prompt_data, cfg.model.hf_checkpoint, cfg.reward.rm_type = "x.jsonl", "m", "exact"
    cfg.data.multimodal_keys = "{image: images}"
    with pytest.raises(ConfigError, match="--multimodal-keys .* is not JSON"):
        validate(cfg)
    cfg.data.multimodal_keys = '{"video": "clips"}'
    with pytest.raises(ConfigError, match=r"modality \['video'\] is not supported"):
        validate(cfg)
    cfg.data.multimodal_keys = '{"image": "images"}'
    cfg.debug.save_debug_rollout_data = "r_{rollout_id}.jsonl"
    with pytest.raises(ConfigError, match="--save-debug-rollout-data does not carry images"):
        validate(cfg)
    cfg.debug.save_debug_rollout_data = None
    cfg.model.true_on_policy = True  # its per-sample scoring would score the text without the images
    with pytest.raises(ConfigError, match="--true-on-policy does not carry images"):
        validate(cfg)
    cfg.model.true_on_policy = False
    cfg.algorithm.advantage_estimator = "gae"  # the critic is a text-only HF class
    with pytest.raises(ConfigError, match="--advantage-estimator gae: the critic has no vision tower"):
        validate(cfg)


def test_both_backends_take_the_image_flags():
    """Image flags pass the start-up check on FSDP and on Megatron (Qwen2.5-VL at one model-parallel rank; its own
    refusals, other VL types and TP/PP/CP/EP > 1, come when the backend builds: tests/backends/megatron/test_vision_cpu.py)."""
    from polyrl.capabilities import refuse_unhonoured
    from polyrl.config import Config
    for section, name, value in (("data", "multimodal_keys", '{"image": "images"}'),
                                 ("model", "freeze_vision_tower", True)):
        for backend in ("fsdp", "megatron"):
            cfg = Config()
            cfg.cluster.train_backend = backend
            setattr(getattr(cfg, section), name, value)
            refuse_unhonoured(cfg)


# ---- embedded engine ------------------------------------------------------------------------------------------------
def _full_forward_logprobs(model, proc, prompt_ids, response_ids, img) -> torch.Tensor:
    """transformers' own forward of the whole sequence (its get_rope_index positions): log-probs of the response."""
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, mm_token_type_ids=(ids == proc.image_token_id).int(),
                       **proc.pixel_inputs([img])).logits[0].float()
    logits[:, proc.placeholder_ids] = float("-inf")  # the engine never samples image / video pads
    lp = torch.log_softmax(logits[len(prompt_ids) - 1:-1], -1)
    return lp.gather(-1, torch.tensor(response_ids)[:, None])[:, 0]


def test_embedded_engine_samples_from_image_prompts_with_the_models_logprobs(vl_model):
    """Sampled at temperature 1, batched with left padding, each token's rollout log-prob is the HF model's log-prob of
    it given the image and the tokens before (positions after the image continue from the largest 3D position), the
    image / video pads excluded from sampling;
    tolerance 1e-4: fp32 logits of a 64-wide model, batched vs one sequence."""
    from transformers import AutoModelForImageTextToText

    from polyrl.rollout.embedded import EmbeddedEngine
    eng = EmbeddedEngine(vl_model)
    imgs = boards(3, seed=1)
    prompts = [eng.processor.encode([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "q" * k}]}],
                                    [img])[0] for k, img in enumerate(imgs)]  # different lengths: left padding
    text_prompt = eng.tokenizer("abc", add_special_tokens=False)["input_ids"]
    out = eng.generate(prompts + [text_prompt], SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=5),
                       images=[[x] for x in imgs] + [None])
    assert len(out) == 8 and out[6].multimodal is None
    hf = AutoModelForImageTextToText.from_pretrained(vl_model).eval()
    for s in out[:6]:
        img = imgs[s.group_index]
        assert s.multimodal["image_grid_thw"].tolist() == [[1, 4, 4]]
        ref = _full_forward_logprobs(hf, eng.processor, s.prompt_ids, s.response_ids, img)
        torch.testing.assert_close(torch.tensor(s.rollout_logprobs), ref, atol=1e-4, rtol=0)
    # same seed, same prompt, alone: the same sample (the per-sample seed stream does not depend on the batch)
    again = eng.generate(prompts[:1], SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=5), images=[[imgs[0]]])
    assert [s.response_ids for s in again] == [s.response_ids for s in out[:2]]


def test_embedded_engine_refuses_ids_without_the_images_tokens(qwen25_vl):
    from polyrl.rollout.embedded import EmbeddedEngine
    eng = EmbeddedEngine(qwen25_vl)
    img = boards(1)[0]
    ids, _ = eng.processor.encode(PROMPT, [img])
    short = [t for t in ids if t != eng.processor.image_token_id][:5] + [eng.processor.image_token_id]
    with pytest.raises(ValueError, match="the prompt has 1 image tokens but its images make 4"):
        eng.generate([short], SamplingParams(max_new_tokens=2), images=[[img]])


# ---- FSDP backend ---------------------------------------------------------------------------------------------------
def _backend(model_dir: str, *, lr: float = 1e-2, freeze: bool = False, **batch):
    from polyrl.backends.fsdp.backend import FSDPBackend
    from polyrl.config import BatchConfig, ModelConfig, OptimizerConfig
    from polyrl.dist import init_distributed
    init_distributed("cpu")
    return FSDPBackend(ModelConfig(hf_checkpoint=model_dir, freeze_vision_tower=freeze), OptimizerConfig(lr=lr),
                       BatchConfig(**batch), device="cpu")


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_fsdp_logprobs_equal_an_unpacked_per_sample_forward(vl_model, layout):
    """One micro-batch of 6 samples (1 or 2 images each, one text-only), packed into one row or padded rows, gives the
    log-probs of running each sample alone through the HF model with its own get_rope_index positions; tolerance 1e-5
    (fp32, the same kernels; only the summation order of attention over the block-diagonal mask differs)."""
    from transformers import AutoModelForImageTextToText
    be = _backend(vl_model, micro_batch_size=8, micro_batch_layout=layout)
    proc = VisionProcessor.from_pretrained(vl_model)
    batch = image_batch(proc)
    got = be.compute_logprobs(batch, temperature=0.7)
    ref = AutoModelForImageTextToText.from_pretrained(vl_model).eval()
    with torch.no_grad():
        for ids, p, mm, lp in zip(batch.input_ids, batch.prompt_lens, batch.multimodal, got):
            kw = {} if mm is None else {**mm, "mm_token_type_ids": (ids == proc.image_token_id).int()[None]}
            logits = ref(input_ids=ids[None], **kw).logits[0].float() / 0.7
            want = torch.log_softmax(logits[p - 1:-1], -1).gather(-1, ids[p:, None])[:, 0]
            torch.testing.assert_close(lp, want, atol=1e-5, rtol=0)


def _loss(logp, ent, fields, *, num_tokens, num_seqs):
    return -(logp * fields["loss_mask"]).sum() / num_tokens, {}


def test_fsdp_train_step_frozen_vision_tower_weight_sync_and_save_hf(qwen25_vl, tmp_path):
    """A train step with --freeze-vision-tower moves the language model, not the vision tower; without it both move
    (the gradient reaches the vision tower through the image tokens); the weight stream carries the vision tower and
    the embedded engine takes it; --save-hf loads back with the HF class and the image processor."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from polyrl.rollout.embedded import EmbeddedEngine
    proc = VisionProcessor.from_pretrained(qwen25_vl)
    batch = image_batch(proc)
    for freeze in (True, False):
        be = _backend(qwen25_vl, freeze=freeze, micro_batch_size=3)
        before = {n: p.detach().clone() for n, p in be.model.lm.named_parameters()}
        m = be.train_step(batch, _loss)
        assert m["skipped_step"] == 0.0 and m["grad_norm"] > 0
        moved = {n for n, p in be.model.lm.named_parameters() if not torch.equal(p, before[n])}
        vision = {n for n in before if n.startswith("model.visual.")}
        assert vision and moved - vision
        assert (moved & vision == set()) if freeze else (vision <= moved)
    names = dict(be.export_weights())
    assert vision <= set(names)
    eng = EmbeddedEngine(qwen25_vl)
    assert set(names) <= set(eng.weight_shapes())  # the engine also lists the tied lm_head under its own name
    eng.update_weights(iter(names.items()), version=1)
    for n in vision:
        torch.testing.assert_close(eng.get_weight(n), names[n].float(), atol=0, rtol=0)
    out = tmp_path / "hf"
    be.save_hf(str(out), proc.tokenizer)
    back = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(out))
    for n, p in back.named_parameters():
        torch.testing.assert_close(p, names[n].float(), atol=0, rtol=0)
    again = VisionProcessor.from_pretrained(str(out))
    img = boards(1)[0]
    assert again.encode(PROMPT, [img])[0] == proc.encode(PROMPT, [img])[0]
    torch.testing.assert_close(again.pixel_inputs([img])["pixel_values"], proc.pixel_inputs([img])["pixel_values"])


def test_fsdp_checkpoint_resume_equals_uninterrupted(qwen25_vl, tmp_path):
    """save -> load into a fresh backend -> the next step's weights equal an uninterrupted run's (bit for bit: the
    same arithmetic on the same state)."""
    proc = VisionProcessor.from_pretrained(qwen25_vl)
    b1, b2 = image_batch(proc, seed=1), image_batch(proc, seed=2)
    a = _backend(qwen25_vl, micro_batch_size=3)
    a.train_step(b1, _loss)
    a.save(str(tmp_path))
    a.train_step(b2, _loss)
    b = _backend(qwen25_vl, micro_batch_size=3)
    b.load(str(tmp_path))
    b.train_step(b2, _loss)
    for (n, p), (_, q) in zip(a.model.lm.named_parameters(), b.model.lm.named_parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0, msg=n)


# ---- polyrl serve + the HTTP engine -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_serve_takes_sglang_image_data_and_the_http_engine_sends_it(qwen25_vl, tmp_path):
    """One `polyrl serve` process on loopback: the HTTP engine's samples of image prompts (input_ids with expanded pads
    + image_data data URLs) equal the embedded engine's (same seeds, same FP32 model: log-probs within 1e-4, BLAS
    order only), carry the pixel inputs, and malformed image_data gets a 400 naming the problem."""
    import urllib.error
    import urllib.request

    from polyrl.rollout.embedded import EmbeddedEngine
    from polyrl.rollout.http_engine import HTTPEngine
    from tests.rollout.test_http_engine import engine_cfg, same_samples

    ref = EmbeddedEngine(qwen25_vl)
    imgs = boards(3, seed=4)
    ps = [ref.processor.encode(PROMPT, [x])[0] for x in imgs]
    sp = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=9)
    want = ref.generate(ps, sp, images=[[x] for x in imgs])
    eng = HTTPEngine(engine_cfg(qwen25_vl, tmp_path, n=1), "cpu")
    try:
        got = eng.generate(ps, sp, images=[[x] for x in imgs])
        same_samples(got, want)
        assert all(torch.equal(g.multimodal["pixel_values"], w.multimodal["pixel_values"]) for g, w in zip(got, want))
        url = eng.servers[0].url
        headers = {"Content-Type": "application/json",
                   **({"Authorization": f"Bearer {eng.http.api_key}"} if eng.http.api_key else {})}

        def post(body):
            req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), headers)
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, e.read().decode()

        status, out = post({"input_ids": ps[0], "image_data": image_data_url(imgs[0]),
                            "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
        assert status == 200 and len(out["output_ids"]) >= 1
        # SGLang's other form: `text` as the chat template renders it, one image pad per image, expanded by the server
        from polyrl.multimodal import place_images
        rendered = ref.processor.tokenizer.apply_chat_template(place_images(PROMPT, 1), add_generation_prompt=True,
                                                               tokenize=False)
        status, by_text = post({"text": rendered, "image_data": image_data_url(imgs[0]),
                                "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
        assert status == 200 and by_text["output_ids"] == out["output_ids"], by_text
        status, text = post({"text": rendered.replace("<|image_pad|>", "<|image_pad|><|image_pad|>"),
                             "image_data": image_data_url(imgs[0])})
        assert status == 400 and "image tokens but its images make 4" in text, text
        for body, msg in (({"input_ids": ps[0], "image_data": "/etc/passwd"}, "send images as data URLs"),
                          ({"input_ids": ps[0][:3], "image_data": image_data_url(imgs[0])}, "image tokens but its images make 4"),
                          ({"input_ids": [ps[0], ps[1]], "image_data": [image_data_url(imgs[0])]}, "list of 2 entries")):
            status, text = post(body)
            assert status == 400 and msg in text, text
    finally:
        eng.close()


def test_image_conversations_for_sft_mask_the_assistant_turns_and_train(qwen25_vl, tmp_path):
    """An SFT row that is a conversation with images (chat messages with assistant turns, no response column): the
    loss mask covers exactly the assistant turns (image pads and user turns 0), the pads are expanded to the image's
    tokens, and `polyrl sft` trains on such rows (the loss falls over a few steps on a repeated batch)."""
    from polyrl.cli import main
    from polyrl.multimodal import build_image_sft_example
    proc = VisionProcessor.from_pretrained(qwen25_vl)
    imgs = boards(8, seed=2)
    rows = [{"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "how many red squares?"}]},
                          {"role": "assistant", "content": str(i % 3)},
                          {"role": "user", "content": "and now?"},
                          {"role": "assistant", "content": str((i + 1) % 3)}],
             "images": [image_data_url(img)]} for i, img in enumerate(imgs)]
    data = tmp_path / "conv.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recs = load_sft_records(str(data), input_key="messages", multimodal_keys={"image": "images"})
    assert [r[1] for r in recs] == [None] * 8  # conversations: the loss is on their assistant turns
    ids, mask, mm = build_image_sft_example(proc, recs[0][0], None, recs[0][3])
    tok = proc.tokenizer
    pads = [i for i, t in enumerate(ids) if t == proc.image_token_id]
    assert len(pads) == 4 and mm["image_grid_thw"].tolist() == [[1, 4, 4]] and not any(mask[i] for i in pads)
    trained = tok.decode([t for t, m in zip(ids, mask) if m]).split()
    # the two answers, each with the template's end-of-turn marker (the model learns to end its turn)
    assert trained[0::2] == ["0", "1"] and trained[1] == trained[3] == tok.eos_token, trained
    assert main(["sft", "--hf-checkpoint", qwen25_vl, "--prompt-data", str(data), "--input-key", "messages",
                 "--multimodal-keys", '{"image": "images"}', "--apply-chat-template", "--global-batch-size", "8",
                 "--num-epoch", "4", "--lr", "5e-3", "--device", "cpu", "--quiet", "--run-dir", str(tmp_path / "run")]) == 0
    losses = [json.loads(line)["sft_loss"] for line in open(tmp_path / "run" / "metrics.jsonl")]
    # the same 8 rows every step: 4 Adam steps at lr 5e-3 on a random tiny model lower their loss by far more than
    # FP32 summation order could move it
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.1, losses
