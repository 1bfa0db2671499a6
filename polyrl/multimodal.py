"""Image prompts for vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): reading images, placing them in chat
messages, the processor that turns them into pixel patches and image tokens, and the multimodal RoPE positions that the
engine and the train backend both compute with the model's own `get_rope_index`.

A prompt row names its images in a column (`--multimodal-keys '{"image": "images"}'`): paths relative to the data file,
`data:image/...;base64,` URLs or bare base64. They fill the prompt's image parts in order: `{"type": "image"}` content
parts of chat messages, or `<image>` markers in string contents. The processor renders the messages with the chat
template (one `<|image_pad|>` per image) and expands each pad to the image's token count, grid (t*h*w) / merge^2.

What a sample carries for the trainer: `{"pixel_values": [patches, C*T*P*P] float, "image_grid_thw": [images, 3]
long}`, the image processor's output for that prompt's images, in order.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import torch

IMAGE_MARKER = "<image>"  # in a string prompt or content: where an image goes (slime's placeholder)
MODALITIES = ("image",)


class ImageError(ValueError):
    """An image that cannot be read or placed; the message names it (the caller adds the file and row)."""


def parse_multimodal_keys(value: str | dict | None) -> dict[str, str]:
    """--multimodal-keys: a JSON object modality -> column, e.g. '{"image": "images"}'."""
    if not value:
        return {}
    try:
        keys = json.loads(value) if isinstance(value, str) else dict(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"--multimodal-keys {value!r} is not JSON ({e}); write e.g. '{{\"image\": \"images\"}}'") from e
    if not isinstance(keys, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in keys.items()):
        raise ValueError(f"--multimodal-keys {value!r}: expected a JSON object of modality -> column names")
    bad = set(keys) - set(MODALITIES)
    if bad:
        raise ValueError(f"--multimodal-keys: modality {sorted(bad)} is not supported (supported: {', '.join(MODALITIES)})")
    return keys


def _short(ref: str) -> str:
    return ref if len(ref) <= 80 else ref[:60] + f"... ({len(ref)} chars)"


def resolve_image_ref(ref: Any, base_dir: str) -> str:
    """A row's image entry as the engines take it: an absolute path (relative paths are relative to the data file's
    directory), or the data URL / base64 string as given."""
    if not isinstance(ref, str) or not ref:
        raise ImageError(f"image entry {ref!r} is not a path, data URL or base64 string")
    if ref.startswith("data:") or _looks_base64(ref):
        return ref
    if ref.startswith(("http://", "https://")):
        raise ImageError(f"image {_short(ref)}: URLs are not fetched (runs read no network); store the file next to "
                         "the data and give its path")
    path = ref if os.path.isabs(ref) else os.path.join(base_dir, ref)
    return os.path.normpath(path)


def _looks_base64(ref: str) -> bool:
    """Bare base64 image bytes rather than a path: base64's alphabet only (no '.', so no file extension), and longer
    than any image header."""
    return len(ref) >= 64 and re.fullmatch(r"[A-Za-z0-9+/=\s]+", ref[:4096]) is not None


def load_image(ref: Any):
    """A PIL RGB image from a path, a data URL, bare base64, raw bytes or a PIL image."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(ref, Image.Image):
        return ref.convert("RGB")
    try:
        if isinstance(ref, (bytes, bytearray)):
            data = bytes(ref)
        elif ref.startswith("data:"):
            head, _, payload = ref.partition(",")
            if ";base64" not in head:
                raise ImageError(f"image {_short(ref)}: only base64 data URLs are supported")
            data = base64.b64decode(payload, validate=True)
        elif _looks_base64(ref):
            data = base64.b64decode(ref, validate=True)
        else:
            if not Path(ref).is_file():
                raise ImageError(f"image file {ref} does not exist")
            data = Path(ref).read_bytes()
        img = Image.open(io.BytesIO(data))
        img.load()
    except (binascii.Error, UnidentifiedImageError, OSError) as e:
        raise ImageError(f"image {_short(ref) if isinstance(ref, str) else type(ref).__name__} is unreadable ({e})") from e
    return img.convert("RGB")


def image_data_url(ref: Any) -> str:
    """An image as SGLang's `image_data` takes it over HTTP: a data URL (paths are read here, on the client)."""
    if isinstance(ref, str) and (ref.startswith("data:") or _looks_base64(ref)):
        return ref if ref.startswith("data:") else "data:image/png;base64," + ref
    buf = io.BytesIO()
    load_image(ref).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def place_images(prompt: str | list[dict], n_images: int) -> list[dict]:
    """Chat messages whose image parts number `n_images`: string prompts and string contents have their `<image>`
    markers turned into image parts. More or fewer images than image parts is an error."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    out, slots = [], 0
    for m in messages:
        content = m["content"]
        if isinstance(content, str):
            pieces = content.split(IMAGE_MARKER)
            parts: list[dict] = []
            for k, text in enumerate(pieces):
                if k:
                    parts.append({"type": "image"})
                if text:
                    parts.append({"type": "text", "text": text})
            content = parts if len(pieces) > 1 else content
        elif isinstance(content, list):
            content = [p if isinstance(p, dict) else {"type": "text", "text": str(p)} for p in content]
        slots += sum(1 for p in content if isinstance(p, dict) and p.get("type") == "image") if isinstance(content, list) else 0
        out.append({**m, "content": content})
    if slots != n_images:
        more = "more" if n_images > slots else "fewer"
        raise ImageError(f"{n_images} image(s) but {slots} image placeholder(s) in the prompt ({more} images than "
                         f"placeholders); mark each image with a {{'type': 'image'}} content part or {IMAGE_MARKER!r}")
    return out


class VisionProcessor:
    """Tokenizer + image processor of a Qwen-VL checkpoint, without transformers' AutoProcessor (which also builds a
    video processor, and that needs torchvision). Renders prompts, expands image pads, makes pixel inputs."""

    def __init__(self, tokenizer, image_processor, image_token_id: int):
        self.tokenizer, self.image_processor, self.image_token_id = tokenizer, image_processor, image_token_id
        self.merge = int(getattr(image_processor, "merge_size", 2))
        video = tokenizer.convert_tokens_to_ids("<|video_pad|>")
        # the tokens an engine never samples: placeholders the processor expands (image, and video where the vocab has it)
        self.placeholder_ids = [image_token_id] + ([video] if isinstance(video, int) and video != tokenizer.unk_token_id
                                                   and video is not None and video >= 0 else [])

    @classmethod
    def from_pretrained(cls, path: str, tokenizer=None) -> "VisionProcessor | None":
        """The checkpoint's processor, or None for a text-only model (no image_token_id in its config)."""
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

        config = AutoConfig.from_pretrained(path)
        token = getattr(config, "image_token_id", None)
        if token is None:
            return None
        if not os.path.isfile(os.path.join(path, "preprocessor_config.json")) and os.path.isdir(path):
            raise ImageError(f"{path} is a vision-language model ({config.model_type}) without preprocessor_config.json; "
                             "save its image processor there")
        image = AutoImageProcessor.from_pretrained(path, backend="pil")  # the PIL path: no torchvision needed
        return cls(tokenizer or AutoTokenizer.from_pretrained(path), image, int(token))

    def save_pretrained(self, path: str) -> None:
        self.image_processor.save_pretrained(path)

    def pixel_inputs(self, images: list) -> dict[str, torch.Tensor]:
        """{"pixel_values": [patches, D], "image_grid_thw": [n, 3]} of the images, in order."""
        out = self.image_processor(images=[load_image(x) for x in images], return_tensors="pt")
        return {"pixel_values": out["pixel_values"].float(), "image_grid_thw": out["image_grid_thw"].long()}

    def tokens_per_image(self, grid_thw: torch.Tensor) -> list[int]:
        return (grid_thw.prod(-1) // (self.merge ** 2)).tolist()

    def expand(self, ids: list[int], grid_thw: torch.Tensor) -> list[int]:
        """Each single image pad of `ids` expanded to its image's token count."""
        return self.expand_masked(ids, [0] * len(ids), grid_thw)[0]

    def expand_masked(self, ids: list[int], mask: list[int], grid_thw: torch.Tensor) -> tuple[list[int], list[int]]:
        """expand(), with a per-token mask whose bit each pad's copies keep."""
        counts, out, out_mask, k = self.tokens_per_image(grid_thw), [], [], 0
        for t, bit in zip(ids, mask):
            if t == self.image_token_id:
                if k >= len(counts):
                    raise ImageError(f"the prompt has more image pads than its {len(counts)} image(s)")
                out += [t] * counts[k]
                out_mask += [bit] * counts[k]
                k += 1
            else:
                out.append(t)
                out_mask.append(bit)
        if k != len(counts):
            raise ImageError(f"{len(counts)} image(s) but {k} image pad(s) in the rendered prompt")
        return out, out_mask

    def check(self, ids: list[int], grid_thw: torch.Tensor) -> None:
        """The (expanded) prompt holds exactly the images' tokens: engines and backends rely on it."""
        have, want = sum(1 for t in ids if t == self.image_token_id), sum(self.tokens_per_image(grid_thw))
        if have != want:
            raise ImageError(f"the prompt has {have} image tokens but its images make {want}; give input ids whose "
                             "image pads are expanded by this model's processor, one run of pads per image")

    def encode(self, prompt: str | list[dict], images: list, apply_chat_template: bool = True
               ) -> tuple[list[int], dict[str, torch.Tensor]]:
        """(expanded token ids, pixel inputs) of a prompt with its images. The chat template renders image parts (so
        image prompts always go through it); a string prompt's `<image>` markers become image parts first."""
        messages = place_images(prompt, len(images))
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        mm = self.pixel_inputs(images)
        return self.expand(list(ids), mm["image_grid_thw"]), mm


def mrope_positions(model, ids: torch.Tensor, grid_thw: torch.Tensor | None, image_token_id: int) -> torch.Tensor:
    """[3, L] multimodal RoPE positions (time, height, width) of one unpadded sequence, from the model's own
    get_rope_index; text-only sequences get the 1D positions on all three rows."""
    if grid_thw is None or not bool((ids == image_token_id).any()):
        return torch.arange(ids.numel(), device=ids.device).expand(3, -1)
    vl = model.model if hasattr(model, "model") and hasattr(model.model, "get_rope_index") else model
    pos, _ = vl.get_rope_index(ids[None], mm_token_type_ids=(ids == image_token_id).int()[None],
                               image_grid_thw=grid_thw.to(ids.device))
    return pos[:, 0]


def concat_inputs(mms: list[dict | None], device) -> dict[str, torch.Tensor]:
    """The pixel inputs of several samples for one forward, in sample order (the order of their image tokens)."""
    mms = [m for m in mms if m is not None]
    if not mms:
        return {}
    return {"pixel_values": torch.cat([m["pixel_values"] for m in mms]).to(device),
            "image_grid_thw": torch.cat([m["image_grid_thw"] for m in mms]).to(device)}


def blank_image(visual) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel values, grid [1, 3]) of the smallest image a Qwen-VL vision tower takes: one merged token of zero
    pixels, in the tower's dtype and device."""
    merge = int(visual.spatial_merge_size)
    w = visual.patch_embed.proj.weight
    pixels = torch.zeros(merge * merge, math.prod(w.shape[1:]), dtype=w.dtype, device=w.device)
    return pixels, torch.tensor([[1, merge, merge]], device=w.device)


def zero_of(out) -> torch.Tensor:
    """0 times the sum of every tensor in `out` (a tensor, or lists / tuples / dicts of them): a term that adds
    nothing to a loss but reaches every parameter that made `out` in the backward."""
    return 0.0 * sum(t.float().sum() for t in _tensors(out))


def idle_vision_term(lm) -> torch.Tensor:
    """0 times the vision tower's output on the smallest image it takes (blank_image): the forward of a rank whose
    micro-batch has no image runs it, before the decoder as a real image would be, so that the vision blocks' FSDP
    all-gathers, and in the backward their reduce-scatters (of zero gradients), match the ranks whose micro-batches
    have images. Adding it changes no log-prob (x + 0.0 == x)."""
    vl = lm.model
    return zero_of(vl.get_image_features(*blank_image(vl.visual)))


def _tensors(x) -> list[torch.Tensor]:
    """Every tensor in a (nested) model output: the vision tower's features, merged features and deepstack lists."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def is_vision_language(config) -> bool:
    return getattr(config, "image_token_id", None) is not None and getattr(config, "vision_config", None) is not None


def train_position_ids(model, input_ids: list[torch.Tensor], mms: list[dict | None], image_token_id: int,
                       text_pos: torch.Tensor, layout: str) -> torch.Tensor:
    """[4, B, W] position ids of a packed ([1, sum L]) or padded ([B, max L]) micro-batch: the 1D text positions that
    `text_pos` holds (HF reads sequence boundaries from them), then each sample's 3D positions, computed on its own, as
    an unpacked forward of that sample computes them."""
    per = [mrope_positions(model, ids, mm["image_grid_thw"] if mm is not None else None, image_token_id)
           for ids, mm in zip(input_ids, mms)]
    if layout == "padded":
        pos3 = torch.zeros(3, *text_pos.shape, dtype=torch.long)
        for i, p in enumerate(per):
            pos3[:, i, :p.shape[1]] = p
    else:
        pos3 = torch.cat(per, dim=1)[:, None]
    return torch.cat([text_pos.cpu()[None], pos3]).to(text_pos.device)


def build_image_sft_example(processor: VisionProcessor | None, prompt, response: str | None, images: list
                            ) -> tuple[list[int], list[int], dict]:
    """(input_ids, loss_mask, pixel inputs) of an SFT row with images: the rendered prompt (mask 0), then the response
    and EOS (mask 1), as polyrl.data.build_sft_example does for text; with response None, the conversation `prompt`
    with mask 1 on its assistant turns (polyrl.data.build_conversation_example), its image pads expanded."""
    if processor is None:
        raise ImageError("the row has images but the model has no image processor (--hf-checkpoint is not a "
                         "vision-language model with a preprocessor_config.json)")
    tok = processor.tokenizer
    if response is None:
        from polyrl.data import build_conversation_example
        ids, mask = build_conversation_example(tok, place_images(prompt, len(images)))
        mm = processor.pixel_inputs(images)
        ids, mask = processor.expand_masked(ids, mask, mm["image_grid_thw"])
        return ids, mask, mm
    prompt_ids, mm = processor.encode(prompt, images)
    response_ids = list(tok(response, add_special_tokens=False)["input_ids"])
    if tok.eos_token_id is not None:
        response_ids.append(tok.eos_token_id)
    return prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids), mm
