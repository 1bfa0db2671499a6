"""One GRPO step with image prompts: `polyrl train` (subprocess) on a Qwen2.5-VL-3B-shaped model with random weights,
built from a config (no downloads), on generated RGB images (448 x 448 by default: 32 x 32 patches of 14 pixels,
merged 2 x 2 into 256 image tokens per image). The rollout is the embedded engine's transformers path (the vision
tower once at prefill, multimodal RoPE positions), the trainer the FSDP backend with packed varlen micro-batches.

The reward is synthetic (sum of the response's token ids mod 5): random weights answer nothing right, and a reward
that differs within a group gives the loss non-zero advantages, so the train phase does its full work.

Prints one table (medians over the measured steps after the warm-up, from the run's metrics.jsonl): step, rollout,
train and weight-sync seconds, generated tokens per rollout second, trained tokens (prompt + response) per train
second, peak GPU memory allocated / reserved during the measured steps (torch.cuda.max_memory_* in the training
process, which holds the engine too; peak RSS on CPU) and image tokens per sample.

  PYTHONPATH=. python3 bench/vlm_step.py --warmup 1 --steps 2 --timeout 220 --out /tmp/vlm_step.json   # one H100
  python bench/vlm_step.py --tiny                                                                       # CPU, seconds

On GPU the default extra flags are `--offload-train --gradient-checkpointing`, chosen by arithmetic, not measured
without them: the trainer's FP32 params, grads and AdamW moments (16 bytes x 3.75B parameters = 60 GB), the engine's
BF16 copy (7.5 GB) and its prefill logits (128 rows x ~290 prompt tokens x 151936 x 2 bytes = 11 GB) leave nothing of
80 GB, and without checkpointing a 16k-token micro-batch's activations (36 layers x ~90 KB per token and layer = 53 GB)
do not fit beside the trainer state.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
from common import char_tokenizer, markdown_table, median, write_json  # noqa: E402

# Qwen2.5-VL-3B-Instruct's config.json (architecture numbers only; weights are random).
QWEN25_VL_3B = dict(
    text=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
              num_key_value_heads=2, vocab_size=151936, max_position_embeddings=128000, rms_norm_eps=1e-6,
              rope_theta=1_000_000.0, mrope_section=[16, 24, 24], tie_word_embeddings=True),
    vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048, patch_size=14,
                spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
                tokens_per_second=2, hidden_act="silu"),
)
# The same layout scaled down so a CPU runs a step in seconds (the same code path: patch 14, merge 2, windowed blocks).
TINY = dict(
    text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=None, max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0,
              mrope_section=[2, 3, 3], tie_word_embeddings=True),
    vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
                tokens_per_second=2, hidden_act="silu"),
)
QUESTION = "how many red squares? answer:"
REWARD = "def reward(sample):\n    return float(sum(sample.response_ids) % 5)\n"
KEYS = ("time/step", "time/rollout", "time/train", "time/weight_sync", "tokens_per_s")
# Runs polyrl's CLI with its per-step log wrapped: the peak memory of each step (then the peak is reset), beside
# metrics.jsonl, so the measured steps' peak leaves out model loading.
WRAPPER = """
import json, resource, sys
import torch
from polyrl import metrics
from polyrl.cli import main
mem_path = sys.argv[1]
orig = metrics.MetricsLogger.log
def log(self, step, m):
    orig(self, step, m)
    row = {"step": int(step), "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        row.update(peak_gpu_alloc_gib=torch.cuda.max_memory_allocated() / 2**30,
                   peak_gpu_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
                   gpu_total_gib=torch.cuda.get_device_properties(0).total_memory / 2**30)
        row["gpu_name"] = torch.cuda.get_device_name(0)
        torch.cuda.reset_peak_memory_stats()
    with open(mem_path, "a") as f:
        f.write(json.dumps(row) + "\\n")
metrics.MetricsLogger.log = log
sys.exit(main(sys.argv[2:]))
"""


def build_tokenizer(vocab_size: int | None, out_dir: str):
    """polyrl.tasks.counting's character tokenizer (Qwen2.5-VL's vision tokens as single added tokens), padded with
    `<xN>` tokens up to the model's vocabulary so any sampled id decodes."""
    return char_tokenizer(vocab_size, out_dir, task="counting")


def build_model_dir(out_dir: str, shape: dict, *, seed: int = 0) -> dict:
    """A local HF directory: Qwen2_5_VLConfig of `shape`, random BF16 weights (initialised on the GPU when there is
    one), the tokenizer and Qwen2-VL's PIL image processor with the shape's patch and merge sizes."""
    import torch
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig, Qwen2VLImageProcessorPil

    from polyrl.tasks.counting import VISION_TOKENS

    os.makedirs(out_dir, exist_ok=True)
    t, v = dict(shape["text"]), dict(shape["vision"])
    tok = build_tokenizer(t.pop("vocab_size"), out_dir)
    patch, merge = v["patch_size"], v["spatial_merge_size"]
    # Qwen2.5-VL's preprocessor_config.json: min_pixels 3136 (56 x 56), max_pixels 12845056 (28 x 28 x 16384)
    Qwen2VLImageProcessorPil(patch_size=patch, temporal_patch_size=v["temporal_patch_size"], merge_size=merge,
                             size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 16384}).save_pretrained(out_dir)
    ids = {name: tok.convert_tokens_to_ids(name) for name in VISION_TOKENS}
    section, theta, tie = t.pop("mrope_section"), t.pop("rope_theta"), t.pop("tie_word_embeddings")
    text = dict(t, vocab_size=len(tok), head_dim=t["hidden_size"] // t["num_attention_heads"],
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
                tie_word_embeddings=tie,
                rope_parameters={"rope_type": "default", "rope_theta": theta, "mrope_section": section})
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=v, image_token_id=ids["<|image_pad|>"],
                           video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=tie)
    torch.manual_seed(seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):
        model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out_dir)
    n_params = sum(p.numel() for p in model.parameters())
    n_vision = sum(p.numel() for n, p in model.named_parameters() if ".visual." in f".{n}")
    del model
    if dev == "cuda":
        torch.cuda.empty_cache()
    return {"params": n_params, "vision_params": n_vision, "vocab_size": len(tok)}


def write_images(out_dir: str, n: int, side: int, *, seed: int = 0) -> str:
    """n RGB images (side x side) of a few coloured rectangles on white, and train.jsonl rows with one image each in a
    chat prompt (paths relative to the file, as --multimodal-keys reads them)."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    path = os.path.join(out_dir, "train.jsonl")
    with open(path, "w") as f:
        for i in range(n):
            img = Image.new("RGB", (side, side), (255, 255, 255))
            d = ImageDraw.Draw(img)
            for _ in range(rng.randint(1, 6)):
                x, y, w = rng.randrange(side), rng.randrange(side), rng.randint(side // 16, side // 4)
                d.rectangle([x, y, x + w, y + w], fill=rng.choice([(220, 30, 30), (30, 60, 220), (30, 160, 60)]))
            name = f"images/{i:05d}.png"
            img.save(os.path.join(out_dir, name))
            f.write(json.dumps({"prompt": prompt, "label": "0", "images": [name]}) + "\n")
    return path


def prompt_tokens(model_dir: str, data_path: str) -> tuple[int, int]:
    """(image tokens, prompt tokens) of the first row as polyrl encodes it: the processor's patches / merge^2, and the
    chat-templated prompt with its image pad expanded to them."""
    from polyrl.data import encode_image_prompt
    from polyrl.multimodal import VisionProcessor
    proc = VisionProcessor.from_pretrained(model_dir)
    row = json.loads(open(data_path).readline())
    images = [os.path.join(os.path.dirname(data_path), x) for x in row["images"]]
    grid = proc.pixel_inputs(images)["image_grid_thw"]
    return int(sum(proc.tokens_per_image(grid))), len(encode_image_prompt(proc, row["prompt"], images))


def polyrl_argv(a, model_dir: str, data: str, rm: str, run_dir: str) -> list[str]:
    argv = ["train", "--hf-checkpoint", model_dir, "--prompt-data", data, "--multimodal-keys", '{"image": "images"}',
            "--apply-chat-template", "--custom-rm-path", f"{rm}:reward", "--device", a.device,
            "--rollout-batch-size", str(a.prompts), "--n-samples-per-prompt", str(a.samples),
            "--rollout-max-response-len", str(a.new_tokens), "--rollout-temperature", "1.0",
            "--num-rollout", str(a.warmup + a.steps), "--lr", "1e-6", "--lr-decay-style", "constant",
            "--advantage-estimator", "grpo", "--no-rollout-shuffle", "--seed", "0", "--rollout-seed", "0",
            "--run-dir", run_dir, "--quiet"]
    return argv + shlex.split(a.polyrl_args)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny model on CPU, 1 step, 2 prompts x 2 samples x 4 tokens, "
                   "56 x 56 images (4 image tokens): a smoke check in seconds")
    p.add_argument("--device", default=None, help="cuda (default) or cpu (--tiny's default)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default 16; --tiny 2)")
    p.add_argument("--samples", type=int, default=None, help="samples per prompt (default 8; --tiny 2)")
    p.add_argument("--new-tokens", type=int, default=None, help="max new tokens (default 128; --tiny 4)")
    p.add_argument("--image-size", type=int, default=None, help="image side in pixels (default 448: 256 image "
                   "tokens; --tiny 56: 4)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps left out of the medians (default 1; --tiny 0)")
    p.add_argument("--steps", type=int, default=None, help="measured steps (default 2; --tiny 1)")
    p.add_argument("--polyrl-args", default=None, help="extra polyrl train flags (default on cuda: "
                   "'--offload-train --gradient-checkpointing'; on cpu: none)")
    p.add_argument("--timeout", type=float, default=200.0, help="seconds the whole run may take (model build and "
                   "polyrl train); the steps logged by then are reported")
    p.add_argument("--workdir", default=None, help="model, data and run dir (default: a new temporary directory)")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    a = p.parse_args(argv)
    tiny = a.tiny
    defaults = dict(device="cpu" if tiny else "cuda", prompts=2 if tiny else 16, samples=2 if tiny else 8,
                    new_tokens=4 if tiny else 128, image_size=56 if tiny else 448, warmup=0 if tiny else 1,
                    steps=1 if tiny else 2)
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.polyrl_args is None:
        a.polyrl_args = "--offload-train --gradient-checkpointing" if a.device == "cuda" else ""
    if a.device not in ("cpu", "cuda"):
        p.error(f"--device {a.device}: choose cpu or cuda")
    for k in ("prompts", "new_tokens", "steps", "image_size"):
        if getattr(a, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1")
    if a.samples < 2:
        p.error("--samples must be >= 2 (GRPO's group baseline needs two samples per prompt)")
    if a.warmup < 0:
        p.error("--warmup must be >= 0")
    return a


def summarize(rows: list[dict], mem: list[dict], warmup: int) -> dict:
    """Medians over the steps after `warmup`; the peak memory is the largest of those steps'."""
    steps = [r for r in rows if r.get("step", 0) > warmup and "time/step" in r]
    out = {k: median([r[k] for r in steps if k in r]) for k in KEYS}
    # trained tokens per sample: its prompt (image tokens included) and its response
    out["response_len/mean"] = median([r["response_len/mean"] for r in steps if "response_len/mean" in r])
    out["steps_measured"] = len(steps)
    out["all_steps_s"] = [r.get("time/step") for r in rows if "time/step" in r]
    measured = [m for m in mem if m["step"] > warmup]
    for k in ("peak_gpu_alloc_gib", "peak_gpu_reserved_gib", "gpu_total_gib", "peak_rss_mib"):
        vals = [m[k] for m in measured if k in m]
        out[k] = max(vals) if vals else float("nan")
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = a.workdir or tempfile.mkdtemp(prefix="vlm_step_")
    model_dir, run_dir = os.path.join(work, "model"), os.path.join(work, "run")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(BENCH),
                                                                    os.environ.get("PYTHONPATH")])))
    t0 = time.perf_counter()
    # built in a process of its own, so this one never holds a CUDA context beside the training process
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import vlm_step as v; "
            "print(json.dumps(v.build_model_dir(sys.argv[2], getattr(v, sys.argv[3]))))")
    deadline = t0 + a.timeout
    try:
        built = subprocess.run([sys.executable, "-c", code, BENCH, model_dir, "TINY" if a.tiny else "QWEN25_VL_3B"],
                               capture_output=True, text=True, timeout=a.timeout, env=env)
    except subprocess.TimeoutExpired:
        print(f"building the model in {model_dir} did not finish within --timeout {a.timeout:.0f} s", file=sys.stderr)
        return 1
    if built.returncode != 0:
        print(f"building the model in {model_dir} failed:\n{built.stderr[-3000:]}", file=sys.stderr)
        return 1
    info = json.loads(built.stdout.strip().splitlines()[-1])
    build_s = time.perf_counter() - t0
    data = write_images(os.path.join(work, "data"), a.prompts * (a.warmup + a.steps), a.image_size)
    n_img, n_prompt = prompt_tokens(model_dir, data)
    rm = os.path.join(work, "reward.py")
    with open(rm, "w") as f:
        f.write(REWARD)
    argv_p = polyrl_argv(a, model_dir, data, rm, run_dir)
    mem_path = os.path.join(work, "memory.jsonl")
    if os.path.exists(mem_path):
        os.remove(mem_path)
    t1 = time.perf_counter()
    try:
        res = subprocess.run([sys.executable, "-c", WRAPPER, mem_path, *argv_p], capture_output=True, text=True,
                             timeout=max(1.0, deadline - time.perf_counter()), env=env)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-3000:]
        print(f"polyrl train was stopped at the --timeout of {a.timeout:.0f} s (model build included; what it logged "
              f"is reported); its stderr tail:\n"
              f"{tail.decode(errors='replace') if isinstance(tail, bytes) else tail}", file=sys.stderr)
        res = None
    train_wall_s = time.perf_counter() - t1
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    rows = []
    if os.path.exists(metrics_path):
        for line in open(metrics_path):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a killed run's last half line
                pass
    mem = [json.loads(line) for line in open(mem_path)] if os.path.exists(mem_path) else []
    if res is not None and res.returncode != 0:
        print(f"polyrl train exited {res.returncode}; its stderr tail:\n{res.stderr[-3000:]}", file=sys.stderr)
    summary = summarize(rows, mem, a.warmup)
    device = next((m["gpu_name"] for m in mem if "gpu_name" in m), a.device)
    result = {"device": device, "shape": "tiny" if a.tiny else "qwen2.5-vl-3b", **info,
              "setting": f"{a.prompts} prompts x {a.samples} samples x {a.new_tokens} new tokens, one "
                         f"{a.image_size}x{a.image_size} image per prompt, median of {a.steps} steps after "
                         f"{a.warmup} warm-up", "image_tokens_per_sample": n_img, "model_build_s": build_s,
              "train_wall_s": train_wall_s, "command": "polyrl " + shlex.join(argv_p), **summary,
              "returncode": None if res is None else res.returncode}
    if a.out:
        write_json(a.out, result)
    f = lambda v, spec="{:.3g}": "-" if v is None or v != v else spec.format(v)  # noqa: E731
    s = summary
    # every sample trains on its prompt (image tokens included) and its response
    trained_tps = ((n_prompt + s["response_len/mean"]) * a.prompts * a.samples / s["time/train"]
                   if s["time/train"] else float("nan"))
    result.update(prompt_tokens=n_prompt, trained_tokens_per_s=trained_tps)
    if a.out:
        write_json(a.out, result)
    mem_cell = (f"{f(s['peak_gpu_alloc_gib'])} / {f(s['peak_gpu_reserved_gib'])} GiB of {f(s['gpu_total_gib'])}"
                if a.device == "cuda" else f"RSS {f(s['peak_rss_mib'], '{:.0f}')} MiB")
    print(f"{device}, {result['shape']} ({info['params'] / 1e9:.3g}B params, {info['vision_params'] / 1e9:.3g}B in "
          f"the vision tower), {result['setting']}; model build {build_s:.1f} s, polyrl train {train_wall_s:.1f} s")
    print(markdown_table(
        ["step s", "rollout s", "train s", "weight-sync s", "generated tok/s", "trained tok/s",
         "peak memory (alloc / reserved)", "image / prompt tokens per sample"],
        [[f(s["time/step"]), f(s["time/rollout"]), f(s["time/train"]), f(s["time/weight_sync"]),
          f(s["tokens_per_s"], "{:.0f}"), f(trained_tps, "{:.0f}"), mem_cell, f"{n_img} / {n_prompt}"]]))
    if res is None or res.returncode != 0 or s["steps_measured"] < a.steps:
        print(f"measured {s['steps_measured']} of {a.steps} steps (run dir {run_dir})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
