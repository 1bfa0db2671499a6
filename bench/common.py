"""Shared pieces of the benchmark scripts: model shapes built from configs (random weights,
no hub), the arithmetic character tokenizer, timing statistics and table printing.

Imports of torch/transformers happen inside the functions, so `--help` of every script is
instant and needs nothing beyond the standard library.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub at run time: every model is built from a config
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Real model shapes (architecture numbers of the public configs), instantiated with random weights.
QWEN_SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}
# Qwen3-MoE-shaped (Qwen3-30B-A3B's layout: 8 of many small experts per token, q/k norm), scaled down to ~1.1B
# parameters (~0.3B active) so a benchmark builds and runs in a minute or two.
QWEN3_MOE_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-moe-1b": dict(hidden_size=1024, intermediate_size=3072, moe_intermediate_size=384, num_experts=64,
                         num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=12, num_attention_heads=16,
                         num_key_value_heads=4, head_dim=64, vocab_size=151936, tie_word_embeddings=True),
    # Qwen3-30B-A3B's layer and vocabulary (its config.json) with 4 of its 48 layers: the experts' bytes per step of
    # the real model at a size that builds in seconds
    "qwen3-30b-a3b-4l": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                             num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=4, num_attention_heads=32,
                             num_key_value_heads=4, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
}
SHAPES = ("tiny", *QWEN_SHAPES, *QWEN3_MOE_SHAPES)


def char_tokenizer(vocab_size: int | None = None, out_dir: str | None = None, task: str = "arithmetic"):
    """A task's one-token-per-character tokenizer (same ids as `polyrl.tasks.<task>.build_tokenizer`; the counting
    task's vision tokens are single added tokens), optionally padded with `<xN>` tokens up to `vocab_size` so a
    big-vocabulary model can sample any id and still decode it. Its decoder concatenates tokens (no spaces), so a
    decoded answer reads "579", not "5 7 9"."""
    import importlib

    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    t = importlib.import_module(f"polyrl.tasks.{task}")
    added = list(getattr(t, "VISION_TOKENS", []))
    base = t.SPECIAL + t.CHARS + added
    vocab = {tk: i for i, tk in enumerate(base)}
    for i in range(len(base), vocab_size or len(base)):
        vocab[f"<x{i}>"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    if added:
        tok.add_special_tokens([AddedToken(tk, normalized=False, special=True) for tk in added])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.chat_template = t.CHAT_TEMPLATE
    if out_dir:
        fast.save_pretrained(out_dir)
    return fast


def fix_decoder(model_dir: str) -> bool:
    """If the saved tokenizer decodes "579" as "5 7 9" (a WordLevel tokenizer without a decoder
    joins tokens with spaces under tokenizers>=0.2x), give it a concatenating decoder, so the
    exact-answer reward can ever match. Returns True when it had to fix it."""
    from tokenizers import decoders
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok("579", add_special_tokens=False)["input_ids"]
    if tok.decode(ids, skip_special_tokens=True) == "579":
        return False
    tok.backend_tokenizer.decoder = decoders.Fuse()
    tok.save_pretrained(model_dir)
    return True


def _random_model(cfg, out_dir: str):
    """Random BF16 weights written to out_dir, as released checkpoints are (the trainer loads FP32 masters from them).
    Initialised on the GPU when there is one: the CPU init of a 7B model took 4 minutes of a 10-minute GPU call."""
    import torch
    from transformers import AutoModelForCausalLM
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out_dir)
    model.to("meta")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return model


def build_model_dir(out_dir: str, shape: str, *, seed: int = 0) -> dict[str, Any]:
    """Write a local HF directory (config, random weights, tokenizer) for `shape`.
    `tiny` is `polyrl.tasks.arithmetic.build_model`'s default model; the qwen shapes are
    Qwen2Config instances of the real sizes with the arithmetic character tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    if shape == "tiny":
        from polyrl.tasks.arithmetic import build_model
        model, _ = build_model(out_dir, seed=seed)
        fixed = fix_decoder(out_dir)
    elif shape in QWEN3_MOE_SHAPES:
        from transformers import Qwen3MoeConfig
        s = QWEN3_MOE_SHAPES[shape]
        tok = char_tokenizer(s["vocab_size"], out_dir)
        cfg = Qwen3MoeConfig(**s, max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
        torch.manual_seed(seed)
        model = _random_model(cfg, out_dir)
        fixed = False
    elif shape in QWEN_SHAPES:
        s = QWEN_SHAPES[shape]
        tok = char_tokenizer(s["vocab_size"], out_dir)
        cfg = Qwen2Config(**s, max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                          pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
                          head_dim=s["hidden_size"] // s["num_attention_heads"])
        torch.manual_seed(seed)
        model = _random_model(cfg, out_dir)
        fixed = False
    else:
        raise ValueError(f"unknown model shape {shape!r}; choose one of {', '.join(SHAPES)}")
    n_params = sum(p.numel() for p in model.parameters())
    del model
    return {"shape": shape, "dir": out_dir, "params": n_params, "tokenizer_decoder_fixed": fixed}


# Peak HBM bandwidth (TB/s) by the name CUDA reports, longest match first: the decode roofline's denominator.
HBM_TBPS = {"H200": 4.8, "H100 NVL": 3.9, "H100 PCIe": 2.0, "H100": 3.35, "H20": 4.0, "B200": 8.0,
            "A100-SXM4-80GB": 2.039, "A100 80GB PCIe": 1.935, "A100": 1.555, "L40S": 0.864}


def hbm_tbps(device_name: str) -> float | None:
    """The device's peak HBM bandwidth in TB/s from HBM_TBPS, or None for a device it does not list."""
    for key in sorted(HBM_TBPS, key=len, reverse=True):
        if key in device_name:
            return HBM_TBPS[key]
    return None


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def fmt(v: Any, spec: str = "{:.3g}") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v:  # nan
            return "-"
        return spec.format(v)
    return str(v)


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A plain-text (Markdown) table: prints readably and pastes into RESULTS.md as is."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def write_json(path: str, obj: Any) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def _busy_cpu_seconds() -> float | None:
    """CPU seconds all processes on this machine have spent busy so far (None if unknown)."""
    try:
        import psutil
        t = psutil.cpu_times()
        return sum(getattr(t, k, 0.0) for k in ("user", "nice", "system", "irq", "softirq", "steal"))
    except ImportError:
        pass
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return (v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class ContentionProbe:
    """How busy the machine was with *other* work while a child process ran: (all busy CPU
    seconds - the reaped children's CPU seconds) / (wall x cores). A benchmark on a shared
    machine reports it beside its timings; more than a few percent means those timings are
    inflated (BLAS/OpenMP threads slow down many times over when cores are oversubscribed)."""

    def __init__(self, in_process: bool = False):
        self.in_process = in_process  # count this process's CPU as ours (else: the children it waited for)

    def _ours(self) -> float:
        import resource
        ru = resource.getrusage(resource.RUSAGE_SELF if self.in_process else resource.RUSAGE_CHILDREN)
        return ru.ru_utime + ru.ru_stime

    def __enter__(self):
        self.t0, self.busy0 = time.perf_counter(), _busy_cpu_seconds()
        self.child0 = self._ours()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.t0
        busy1 = _busy_cpu_seconds()
        ours = self._ours()
        self.child_cpu_s = ours - self.child0
        if busy1 is None or self.busy0 is None or self.wall <= 0:
            self.other_frac = None
        else:
            other = max(busy1 - self.busy0 - self.child_cpu_s, 0.0)
            self.other_frac = other / (self.wall * (os.cpu_count() or 1))
        return False


def wait_for_quiet(max_seconds: float, *, busy_below: float = 0.08, window: float = 5.0) -> float | None:
    """Block until the machine's CPUs were less than `busy_below` busy over a `window`, or
    `max_seconds` passed. Returns the last busy share seen (None if it cannot be read)."""
    deadline = time.monotonic() + max_seconds
    share = None
    while True:
        b0, t0 = _busy_cpu_seconds(), time.perf_counter()
        time.sleep(window)
        b1 = _busy_cpu_seconds()
        if b0 is None or b1 is None:
            return None
        share = (b1 - b0) / ((time.perf_counter() - t0) * (os.cpu_count() or 1))
        if share < busy_below or time.monotonic() >= deadline:
            return share
