"""A block-FP8 copy of an HF checkpoint, for a launched SGLang under `--rollout-quantization fp8`.

SGLang builds FP8 linear layers (and so accepts the FP8 weight stream polyrl syncs) only when the checkpoint it starts
from says `quantization_config: {quant_method: fp8, weight_block_size: [128, 128]}`; it cannot be told so for a BF16
checkpoint. So the launch path writes, once per run, a copy of --hf-checkpoint with every weight that
polyrl.weight_sync.quantize quantizes stored as `weight` (float8_e4m3fn) + `weight_scale_inv` (float32), the rest as
they are, the tokenizer and the other small files beside them, and points SGLang's --model-path at it. The copy's
values are the checkpoint's own quantized; the first weight push replaces them with the trainer's.
"""

from __future__ import annotations

import json
import os
import shutil

from polyrl.weight_sync.quantize import QUANTIZATION_CONFIG, TRANSPOSED_EXPERTS, quantize_stream

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
INDEX = "model.safetensors.index.json"


def write_fp8_checkpoint(src: str, dst: str) -> str:
    """Write the block-FP8 copy of the HF directory `src` at `dst` (atomically: a half-written copy never has the final
    name) and return `dst`; an existing `dst` is kept (one copy per run, whichever engine asks first)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if os.path.isfile(os.path.join(dst, "config.json")):
        return dst
    shards = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    if not shards:
        raise FileNotFoundError(f"--rollout-quantization fp8 with a launched SGLang: {src} has no .safetensors weights "
                                "to write the FP8 checkpoint from")
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if config.get("quantization_config"):
        raise ValueError(f"--rollout-quantization fp8: {src} is already quantized "
                         f"({config['quantization_config'].get('quant_method')}); give a BF16/FP32 checkpoint")
    stacked = config.get("model_type") not in TRANSPOSED_EXPERTS
    tmp = dst.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    weight_map: dict[str, str] = {}
    for shard in shards:
        with safe_open(os.path.join(src, shard), framework="pt") as f:
            tensors = ((name, f.get_tensor(name)) for name in f.keys())
            out = {n: t.contiguous() for n, t in quantize_stream(tensors, stacked_experts=stacked)}
        save_file(out, os.path.join(tmp, shard), metadata={"format": "pt"})
        weight_map.update((n, shard) for n in out)
    for name in os.listdir(src):  # the tokenizer, generation config, chat template, processor files
        path = os.path.join(src, name)
        if os.path.isfile(path) and not name.endswith(_WEIGHT_SUFFIXES) and name not in (INDEX, "config.json"):
            shutil.copy2(path, os.path.join(tmp, name))
    config["quantization_config"] = dict(QUANTIZATION_CONFIG)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if len(shards) > 1:
        with open(os.path.join(tmp, INDEX), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    os.replace(tmp, dst)
    return dst
