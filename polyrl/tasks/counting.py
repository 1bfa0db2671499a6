"""Counting shapes in generated images: "how many red squares?" for a tiny vision-language model.

Each image is a GRID x GRID board of CELL-pixel cells; a cell is empty, or holds a red square, a blue square or a red
dot. The answer is the number of red squares (0..MAX_COUNT), so the model must tell colour and shape apart and add.
A cell is exactly one image token (CELL = PATCH * merge size 2), so the images differ token by token and a model of
width 64 learns the task from a few hundred demonstrations. The SFT demonstrations are noisy (a share answer the count
of everything red, squares and dots alike), which SFT imitates and a verifier-based RL step can unlearn: the gap
examples/vlm_counting measures.
"""

from __future__ import annotations

import json
import os
import random

from polyrl.types import Sample

GRID, CELL, PATCH = 2, 16, 8  # a 32 x 32 image; 8-pixel patches merged 2x2: one image token per cell, 4 in all
MAX_COUNT = 4
QUESTION = "how many red squares?"
CHARS = list("0123456789abcdefghijklmnopqrstuvwxyz ?:")
SPECIAL = ["<pad>", "<eos>"]
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2.5-VL's way of writing an image part (vision start, one pad the processor expands to the image's tokens, vision
# end); text parts and string contents as they are; an assistant turn ends with EOS
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% if m['role'] == 'assistant' %}<eos>{% endif %}{% endfor %}"
)
RED, BLUE, WHITE = (220, 30, 30), (30, 60, 220), (255, 255, 255)


def build_tokenizer(out_dir: str | None = None):
    """One token per character, and the Qwen2.5-VL vision tokens as single added tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + CHARS + VISION_TOKENS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in VISION_TOKENS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.chat_template = CHAT_TEMPLATE
    if out_dir:
        fast.save_pretrained(out_dir)
    return fast


def build_image_processor(out_dir: str | None = None):
    """Qwen2-VL's PIL image processor (no torchvision needed), sized for PATCH-pixel patches."""
    from transformers import Qwen2VLImageProcessorPil

    side = GRID * CELL
    image = Qwen2VLImageProcessorPil(patch_size=PATCH, temporal_patch_size=2, merge_size=2,
                                     size={"shortest_edge": side * side, "longest_edge": 4 * side * side})
    if out_dir:
        image.save_pretrained(out_dir)
    return image


def build_model(out_dir: str, *, hidden: int = 64, layers: int = 2, vision_depth: int = 2, seed: int = 0,
                arch: str = "qwen2_5_vl"):
    """A tiny Qwen2.5-VL (or Qwen3-VL) with random weights, saved with its processor as a local HF directory."""
    import torch
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig, Qwen3VLConfig

    from polyrl.multimodal import VisionProcessor

    tok = build_tokenizer(out_dir)
    image = build_image_processor(out_dir)
    heads, head_dim = 4, hidden // 4
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=256,
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
                tie_word_embeddings=True)
    # the rotary halves split over (time, height, width): Qwen's mrope_section sums to head_dim / 2
    section = [head_dim // 2 - 2 * (head_dim // 6), head_dim // 6, head_dim // 6]
    if arch == "qwen2_5_vl":
        vision = dict(depth=vision_depth, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden,
                      patch_size=PATCH, spatial_merge_size=2, temporal_patch_size=2, window_size=4 * PATCH,
                      fullatt_block_indexes=[vision_depth - 1])
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
        cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                               video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                               vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True)
    elif arch == "qwen3_vl":
        vision = dict(depth=vision_depth, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden,
                      patch_size=PATCH, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                      deepstack_visual_indexes=[0])
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section,
                                   "mrope_interleaved": True}
        cfg = Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                            video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                            vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True)
    else:
        raise ValueError(f"arch {arch!r}: choose qwen2_5_vl or qwen3_vl")
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out_dir)
    return model, VisionProcessor(tok, image, ids["<|image_pad|>"])


def draw_board(cells: list[str]):
    """A PIL image of GRID*GRID cells, each "" (empty), "rs" (red square), "bs" (blue square) or "rd" (red dot)."""
    from PIL import Image, ImageDraw

    side = GRID * CELL
    img = Image.new("RGB", (side, side), WHITE)
    d = ImageDraw.Draw(img)
    for k, c in enumerate(cells):
        x, y = (k % GRID) * CELL, (k // GRID) * CELL
        if c in ("rs", "bs"):
            d.rectangle([x + 2, y + 2, x + CELL - 3, y + CELL - 3], fill=RED if c == "rs" else BLUE)
        elif c == "rd":  # half a square's width: about a fifth of its red
            d.ellipse([x + CELL // 2 - 3, y + CELL // 2 - 3, x + CELL // 2 + 2, y + CELL // 2 + 2], fill=RED)
    return img


def make_board(rng: random.Random) -> tuple[list[str], int, int]:
    """(cells, red squares, red things): 0..MAX_COUNT red squares (uniform), each other cell empty, a blue square or
    a red dot (a third each), in random cells."""
    n_red = rng.randint(0, MAX_COUNT)
    cells = ["rs"] * n_red + [rng.choice(["", "bs", "rd"]) for _ in range(GRID * GRID - n_red)]
    rng.shuffle(cells)
    return cells, n_red, n_red + cells.count("rd")


def write_datasets(out_dir: str, *, n_train: int = 512, n_eval: int = 64, shortcut_rate: float = 0.7,
                   seed: int = 0, question: str = f"{QUESTION} answer:") -> dict[str, str]:
    """Writes images/*.png and sft.jsonl (prompt/response/images: a `shortcut_rate` share of the answers count every
    red thing), train.jsonl and eval.jsonl (prompt/label/images). Paths in the rows are relative to the files."""
    rng = random.Random(seed)
    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    rows = []
    for i in range(n_train + n_eval):
        cells, n, shortcut = make_board(rng)
        name = f"images/{i:05d}.png"
        draw_board(cells).save(os.path.join(out_dir, name))
        rows.append((name, n, shortcut))
    paths = {k: os.path.join(out_dir, f"{k}.jsonl") for k in ("sft", "train", "eval")}
    with open(paths["sft"], "w") as f:
        for name, n, shortcut in rows[:n_train]:
            answer = shortcut if rng.random() < shortcut_rate else n
            f.write(json.dumps({"prompt": prompt, "response": str(answer), "images": [name]}) + "\n")
    for key, part in (("train", rows[:n_train]), ("eval", rows[n_train:])):
        with open(paths[key], "w") as f:
            for name, n, _ in part:
                f.write(json.dumps({"prompt": prompt, "label": str(n), "images": [name]}) + "\n")
    return paths


def reward(sample: Sample) -> float:
    """1.0 when the response is exactly the count."""
    return 1.0 if sample.response.strip() == str(sample.label).strip() else 0.0
